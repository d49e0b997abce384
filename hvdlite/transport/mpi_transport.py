"""MPI, the first transport (see transport.py): one mpi4py communicator per transport.

Importing this module imports mpi4py, which initialises MPI unless the program set
``mpi4py.rc.initialize = False``: only ``open_world`` (from ``hvdlite.init()``) and
code that already runs under MPI import it.
"""
from __future__ import annotations

import array
import os
import pickle
import time
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np
from mpi4py import MPI

from hvdlite.errors import HvdliteError, UsageError
from hvdlite.reduce_op import ReduceOp
from hvdlite.transport import mpi_init
from hvdlite.transport.base import Await, TransportKind, check_data_op
from hvdlite.transport.mpi_library import library_from_version
from hvdlite.transport.waits import wait_all

# A verdict is a few small messages; waiting this long for them to leave is enough
# on any working network and bounded on a broken one.
VERDICT_SEND_WAIT_S = 0.5
_TAG_PING, _TAG_VERDICT = 1, 2   # on the liveness channel's private communicator only
_OPS = {ReduceOp.SUM: MPI.SUM, ReduceOp.MIN: MPI.MIN, ReduceOp.MAX: MPI.MAX,
        ReduceOp.PRODUCT: MPI.PROD}


class MpiRound:
    """One set's bitwise-AND round over ``vector``. Where the MPI library has MPI-4's
    persistent collectives the allreduce is built once (``Allreduce_init``) and started
    each round: after 5 ms of idle, starting it took 8-11 us here against 18 us for a
    fresh ``Iallreduce``. Elsewhere each round posts an ``Iallreduce``. Made where the
    set is registered, a collective point on every member, as the persistent call
    requires."""

    def __init__(self, comm: MPI.Comm, vector: array.array) -> None:
        self._comm, self._vector = comm, vector
        try:
            self._persistent: Optional[MPI.Request] = comm.Allreduce_init(
                MPI.IN_PLACE, vector, op=MPI.BAND)
        except (NotImplementedError, AttributeError, MPI.Exception):
            self._persistent = None     # MPI before 4, or a stand-in communicator

    def start(self) -> MPI.Request:
        if self._persistent is None:
            return self._comm.Iallreduce(MPI.IN_PLACE, self._vector, op=MPI.BAND)
        self._persistent.Start()
        return self._persistent

    def free(self) -> None:
        if self._persistent is not None:
            self._persistent.Free()
            self._persistent = None


class Channel:
    """Pings and verdicts on a private duplicate of the engine's world communicator,
    so they never match the engine's collectives or user traffic."""

    def __init__(self, world: MPI.Comm) -> None:
        self.comm = world.Dup()
        self._ping = np.zeros(1, dtype=np.uint8)   # content is irrelevant, never written
        self._inbox = np.zeros(1, dtype=np.uint8)
        self._status = MPI.Status()
        self._pings: dict[int, MPI.Request] = {}

    def ping(self, ranks: Sequence[int]) -> None:
        for rank in ranks:
            previous = self._pings.get(rank)
            if previous is not None and not previous.Test():
                continue   # not delivered yet (a dead peer's queue is full): don't pile up
            self._pings[rank] = self.comm.Isend([self._ping, MPI.BYTE], dest=rank, tag=_TAG_PING)

    def drain(self) -> tuple[set[int], list[tuple[int, str]]]:
        """Ranks heard from, and the verdicts received as (reporter, text)."""
        # Forget delivered pings, so finished requests do not pile up until MPI_Finalize.
        self._pings = {rank: req for rank, req in self._pings.items() if not req.Test()}
        heard: set[int] = set()
        verdicts: list[tuple[int, str]] = []
        while self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=self._status):
            source, tag = self._status.Get_source(), self._status.Get_tag()
            heard.add(source)
            if tag == _TAG_PING:
                self.comm.Recv([self._inbox, MPI.BYTE], source=source, tag=tag)
            else:
                verdicts.append((source, self.comm.recv(source=source, tag=tag)))
        return heard, verdicts

    def tell(self, ranks: Sequence[int], text: str) -> None:
        requests = [self.comm.isend(text, dest=rank, tag=_TAG_VERDICT) for rank in ranks]
        deadline = time.monotonic() + VERDICT_SEND_WAIT_S
        while not MPI.Request.Testall(requests) and time.monotonic() < deadline:
            time.sleep(1e-3)


class MpiLane:
    """A lane (hvdlite/engine/lane.py) on a communicator of its own."""

    def __init__(self, comm: MPI.Comm) -> None:
        self._comm = comm

    def start_sum(self, buf: np.ndarray) -> MPI.Request:
        return self._comm.Iallreduce(MPI.IN_PLACE, buf, op=MPI.SUM)

    def start_reduce_scatter(self, buf: np.ndarray, out: np.ndarray,
                             counts: Sequence[int]) -> MPI.Request:
        return self._comm.Ireduce_scatter(buf, out, list(counts), op=MPI.SUM)

    def start_allgather(self, buf: np.ndarray, out: np.ndarray,
                        counts: Sequence[int]) -> MPI.Request:
        return self._comm.Iallgatherv(buf, [out, list(counts)])

    def close(self) -> None:
        self._comm.Free()


class MpiTransport:
    """The Transport protocol on one mpi4py communicator (``comm``), which the host
    backends are opened on as well."""
    name, label = "mpi", "MPI"
    kind = TransportKind.MPI
    lost_rank_wait = "MPI_Finalize would wait for the lost rank forever"
    failures: tuple[type[BaseException], ...] = (MPI.Exception,)
    # An idle round is a few microseconds of MPI_Iallreduce on each rank.
    idle_tick_s = 0.1

    def __init__(self, comm: MPI.Comm) -> None:
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()  # fixed for a communicator

    def band_round(self, vector: array.array) -> MpiRound:
        return MpiRound(self.comm, vector)

    def allgather(self, obj: Any) -> list[Any]:
        return self.comm.allgather(obj)

    def bcast(self, obj: Any, root: int = 0) -> Any:
        return self.comm.bcast(obj, root=root)

    # A peer can die after it joined a round's bit-vector allreduce but before the full
    # round's gather: with blocking collectives, the survivors would then wait inside
    # MPI forever, where no liveness check can run. Hence non-blocking ones, awaited.
    def gather_awaited(self, obj: Any, wait: Await) -> Optional[list[Any]]:
        comm = self.comm
        data = np.frombuffer(pickle.dumps(obj, pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
        root = self.rank == 0
        sizes = np.zeros(self.size if root else 1, dtype=np.int64)
        wait([comm.Igather(np.array([data.size], dtype=np.int64), sizes if root else None)])
        offsets = np.concatenate(([0], np.cumsum(sizes)[:-1])) if root else sizes
        out = np.empty(int(sizes.sum()) if root else 0, dtype=np.uint8)
        wait([comm.Igatherv([data, MPI.BYTE],
                            [out, (sizes, offsets), MPI.BYTE] if root else None)])
        if not root:
            return None
        return [pickle.loads(out[o:o + n]) for o, n in zip(offsets, sizes)]

    def bcast_awaited(self, obj: Any, wait: Await) -> Any:
        comm = self.comm
        root = self.rank == 0
        data = np.frombuffer(bytearray(pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)),
                             dtype=np.uint8) if root else None
        size = np.array([data.size if data is not None else 0], dtype=np.int64)
        wait([comm.Ibcast(size)])
        buf = data if data is not None else np.empty(int(size[0]), dtype=np.uint8)
        wait([comm.Ibcast([buf, MPI.BYTE])])
        return obj if root else pickle.loads(buf)

    def dup(self) -> MpiTransport:
        return MpiTransport(self.comm.Dup())

    def split(self, color: Optional[int], key: int) -> Optional[MpiTransport]:
        comm = self.comm.Split(MPI.UNDEFINED if color is None else color, key=key)
        return None if comm == MPI.COMM_NULL else MpiTransport(comm)

    def split_node(self, key: int) -> MpiTransport:
        return MpiTransport(self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=key))

    def free(self) -> None:
        self.comm.Free()

    def liveness_channel(self) -> Channel:
        return Channel(self.comm)

    def lane_channel(self) -> MpiLane:
        return MpiLane(self.comm.Dup())

    def allreduce_array(self, buf: np.ndarray, op: ReduceOp) -> None:
        check_data_op(self.rank, op)
        wait_all([self.comm.Iallreduce(MPI.IN_PLACE, buf, op=_OPS[op])])

    def broadcast_array(self, buf: np.ndarray, root: int) -> None:
        wait_all([self.comm.Ibcast([buf, MPI.BYTE], root=root)])

    def allgather_array(self, send: np.ndarray, recv: np.ndarray,
                        counts: Sequence[int]) -> None:
        item = send.itemsize
        sizes = [int(c) * item for c in counts]
        offsets = np.concatenate(([0], np.cumsum(sizes)[:-1])).tolist()
        wait_all([self.comm.Iallgatherv([send, MPI.BYTE],
                                          [recv, (sizes, offsets), MPI.BYTE])])

    def alltoall_array(self, send: np.ndarray, send_counts: Sequence[int],
                       recv: np.ndarray, recv_counts: Sequence[int]) -> None:
        item = send.itemsize
        out, into = [int(c) * item for c in send_counts], [int(c) * item for c in recv_counts]
        wait_all([self.comm.Ialltoallv([send, (out, _offsets(out)), MPI.BYTE],
                                         [recv, (into, _offsets(into)), MPI.BYTE])])

    def abort(self, status: int) -> None:
        """End the whole job: MPI_Abort on COMM_WORLD, also where the engine runs on a
        sub-communicator (init(comm=...)), on which MPI need only end its members."""
        MPI.COMM_WORLD.Abort(status)


def _offsets(sizes: Sequence[int]) -> list[int]:
    return np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(int).tolist()


# -- opening the world (hvdlite.init) ------------------------------------------------------
def initialize() -> None:
    """MPI initialised at a thread level the engine can use (see mpi_init)."""
    mpi_init.ensure_initialized()


def world_rank() -> int:
    return MPI.COMM_WORLD.Get_rank()


def check_launch(world_size: int, environ: Optional[Mapping[str, str]] = None) -> None:
    """Refuse the classic SLURM mistake: srun started N tasks but each one is its
    own MPI world of size 1 (srun --mpi=none, or a PMI its MPI does not speak), which
    would silently train N independent copies of the model."""
    environ = os.environ if environ is None else environ
    try:
        tasks = int(environ.get("SLURM_STEP_NUM_TASKS", environ.get("SLURM_NTASKS", "1")))
    except ValueError:
        return
    if "SLURM_PROCID" in environ and tasks > 1 and world_size == 1:
        library = library_from_version(MPI.Get_library_version())
        raise HvdliteError(
            f"srun started {tasks} tasks, but this one (SLURM_PROCID="
            f"{environ['SLURM_PROCID']}) is an MPI world of size 1: the tasks cannot see "
            f"each other. srun must use the PMI of your MPI, here {library.name} "
            f"({library.version}): `srun --mpi={library.srun_mpi}` (or export "
            f"SLURM_MPI_TYPE={library.srun_mpi}); `hvdliterun --check` names it. (MPICH "
            "needs pmi2, Open MPI pmix.)")


def open_world(comm: Union[MPI.Comm, Sequence[int], None],
               shared_memory: bool = True) -> MpiTransport:
    """The engine's world: COMM_WORLD, a communicator the program passed, or the listed
    COMM_WORLD ranks (``hvdlite.init(comm=...)``). Collective over those ranks.
    ``shared_memory`` (HVDLITE_SHARED_MEMORY) is the torch transport's: MPI libraries
    move data within a node through its shared memory on their own."""
    check_launch(MPI.COMM_WORLD.Get_size())
    if comm is None:
        return MpiTransport(MPI.COMM_WORLD)
    if isinstance(comm, MPI.Comm):
        return MpiTransport(comm)
    ranks = sorted(int(r) for r in comm)
    me = MPI.COMM_WORLD.Get_rank()
    if me not in ranks:
        raise UsageError(f"rank {me} called init(comm={ranks}) but is not in that list; "
                         "only the listed ranks may call it")
    return MpiTransport(MPI.COMM_WORLD.Create_group(MPI.COMM_WORLD.Get_group().Incl(ranks)))


def threads_multiple() -> bool:
    """Whether the program's own mpi4py calls may run beside the engine's."""
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def world_ranks(comm: MPI.Comm, world: Optional[MpiTransport]) -> list[int]:
    """The ranks in ``world`` (COMM_WORLD if None) of ``comm``'s members, in its order."""
    world_comm = MPI.COMM_WORLD if world is None else world.comm
    members, everyone = comm.Get_group(), world_comm.Get_group()
    try:
        ranks = list(members.Translate_ranks(list(range(comm.Get_size())), everyone))
    finally:
        members.Free()
        everyone.Free()
    if MPI.UNDEFINED in ranks:
        raise UsageError(f"ProcessSet(communicator): {ranks.count(MPI.UNDEFINED)} of its "
                         "members are outside the world hvdlite runs on")
    return ranks
