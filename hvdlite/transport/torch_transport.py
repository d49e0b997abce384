"""torch.distributed as a transport (hvdlite/transport/base.py): what ``hvdlite.init()``
runs on under ``torchrun``, with or without mpi4py installed. Negotiation, small objects
and host data travel over Gloo process groups, except where every rank of a transport
shares a host: its negotiation rounds and allreduce then go through the node's shared
memory (hvdlite/transport/node_memory.py). Liveness pings and verdicts go over the job's
key-value store (out of band: a peer stuck in a collective still gets them).

Limits, by design of torch.distributed: a group is made by every process of the
world (``new_group``), so only a transport spanning the world splits; and torch
numbers a group's ranks in global order, so a split with another key order is
renumbered here (``members``). The host data runs on the registry's built-in
"transport" backend (hvdlite/backends/on_transport.py), which the chain asks on this
world instead of the MPI ones. CUDA buffers go over torch's NCCL, in a process group
of each set's members (``device_group``; hvdlite/backends/torch_nccl.py).
"""
from __future__ import annotations

import array
import atexit
import functools
import os
import pickle
import socket
from typing import Any, Hashable, Optional, Sequence, Union

import numpy as np
import torch
import torch.distributed as dist

from hvdlite.errors import HvdliteError, UsageError
from hvdlite.reduce_op import ReduceOp
from hvdlite.transport.base import Await, TransportKind, check_data_op
from hvdlite.transport.handoff import HANDOFF
from hvdlite.transport.node_lane import NodeLane
from hvdlite.transport.node_memory import NodeMemory, NodeRound, open_node_memory
from hvdlite.transport.store_channel import StoreChannel
from hvdlite.transport.torch_work import OPTIONS, TorchLane, TorchPending, TorchRound, block

_GLOO_WIDER = {np.dtype(np.int16): np.dtype(np.int32), np.dtype(np.uint16): np.dtype(np.int32),
               np.dtype(np.uint32): np.dtype(np.int64)}
_SIGN64 = np.int64(-2**63)
class TorchTransport:
    name, label = "gloo", "torch.distributed (gloo)"
    kind = TransportKind.TORCH
    lost_rank_wait = ("torch.distributed (gloo) would wait for the lost rank at shutdown, and "
                      "a job that lost a rank must not end with status 0")
    failures: tuple[type[BaseException], ...] = (RuntimeError,)   # torch's DistBackendError too
    # An idle round here costs each rank about a millisecond of CPU on Gloo's threads
    # (microseconds over MPI); at 0.1 s, the transformer's 0.45 s steps paid for some
    # four rounds each that agreed nothing (BENCHMARKS.md, twelfth session).
    idle_tick_s = 0.4

    def __init__(self, group: Any, members: Sequence[int], shared_memory: bool = True) -> None:
        self.group, self.members = group, list(members)    # global ranks, in our rank order
        self.rank, self.size = self.members.index(dist.get_rank()), len(self.members)
        ordered = sorted(self.members)
        self._torch_index = [ordered.index(g) for g in self.members]   # ours -> torch's
        self._shared_memory = shared_memory          # the setting, which splits inherit
        self._node_memory: Optional[NodeMemory] = None
        self._node_memory_tried = False

    def _ours(self, by_torch_rank: Sequence[Any]) -> list[Any]:
        return [by_torch_rank[i] for i in self._torch_index]

    def band_round(self, vector: array.array) -> Union[NodeRound, TorchRound]:
        memory = self._opened_node_memory()
        node_round = memory.band_round(vector) if memory is not None else None
        return node_round or TorchRound(self.group, vector)

    def _opened_node_memory(self) -> Optional[NodeMemory]:
        """The node's shared memory (HVDLITE_SHARED_MEMORY), opened at the first round
        or allreduce: every rank makes either at the same point of its sequence of
        collectives, so every rank opens it (or gives up on it) together."""
        if self._shared_memory and not self._node_memory_tried and self.size > 1:
            self._node_memory_tried = True
            self._node_memory = self._new_node_memory()
        return self._node_memory

    def _new_node_memory(self) -> Optional[NodeMemory]:
        """Segments of the node's memory for these ranks (collective), or None on every
        rank; a waiting rank gives up on a peer after torch's own collective timeout."""
        return open_node_memory(self, timeout_s=dist.default_pg_timeout.total_seconds())

    # The small objects travel as bytes in tensors of hvdlite's own (not torch's
    # all_gather_object), which HANDOFF holds until Gloo has let go of them.
    def allgather(self, obj: Any) -> list[Any]:
        parts = self._gather_bytes(pickle.dumps(obj, pickle.HIGHEST_PROTOCOL), block)
        return [pickle.loads(p) for p in parts]

    def bcast(self, obj: Any, root: int = 0) -> Any:
        return self._bcast(obj, root, block)

    def _gather_bytes(self, data: bytes, wait: Await) -> list[bytes]:
        """Every rank's bytes, in our rank order, on every rank: Gloo's all_gather wants
        equal sizes, so the sizes first, then the data padded to the longest."""
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        mine = torch.tensor([len(data)], dtype=torch.int64)
        wait([TorchPending(dist.all_gather(sizes, mine, group=self.group, async_op=True),
                           mine, *sizes)])
        longest = max(int(s[0]) for s in sizes)
        if longest == 0:        # nothing from anyone (an allgather of empty arrays)
            return [b""] * self.size
        padded = torch.zeros(longest, dtype=torch.uint8)
        if data:                # torch.frombuffer refuses an empty buffer
            padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.size)]
        wait([TorchPending(dist.all_gather(out, padded, group=self.group, async_op=True),
                           padded, *out)])
        return self._ours([o[: int(s[0])].numpy().tobytes() for o, s in zip(out, sizes)])

    def gather_awaited(self, obj: Any, wait: Await) -> Optional[list[Any]]:
        parts = self._gather_bytes(pickle.dumps(obj, pickle.HIGHEST_PROTOCOL), wait)
        return [pickle.loads(p) for p in parts] if self.rank == 0 else None

    def bcast_awaited(self, obj: Any, wait: Await) -> Any:
        return self._bcast(obj, 0, wait)

    def _bcast(self, obj: Any, ours: int, wait: Await) -> Any:
        root = self.members[ours]
        data = pickle.dumps(obj, pickle.HIGHEST_PROTOCOL) if self.rank == ours else b""
        size = torch.tensor([len(data)], dtype=torch.int64)
        wait([TorchPending(dist.broadcast(size, src=root, group=self.group, async_op=True),
                           size)])
        buf = torch.zeros(int(size[0]), dtype=torch.uint8)
        if self.rank == ours:
            buf[:] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        wait([TorchPending(dist.broadcast(buf, src=root, group=self.group, async_op=True),
                           buf)])
        return obj if self.rank == ours else pickle.loads(buf.numpy().tobytes())

    def _split(self, color: Optional[Hashable], key: int) -> Optional[TorchTransport]:
        if self.size != dist.get_world_size():
            raise HvdliteError(
                f"rank {self.rank}: a torch.distributed group is made by every process "
                f"of the world, so only a transport of all {dist.get_world_size()} ranks "
                f"splits, not one of {self.size}; split the world transport instead")
        entries = self.allgather((color, key))
        mine = None
        for each in sorted({c for c, _ in entries if c is not None}, key=repr):
            members = [self.members[i] for _, i in
                       sorted((k, i) for i, (c, k) in enumerate(entries) if c == each)]
            group = dist.new_group(ranks=members, backend="gloo")   # every process, each group
            if each == color:
                mine = TorchTransport(group, members, self._shared_memory)
        return mine

    def dup(self) -> TorchTransport:
        twin = self._split(0, self.rank)
        assert twin is not None
        return twin

    def split(self, color: Optional[int], key: int) -> Optional[TorchTransport]:
        return self._split(color, key)

    def split_node(self, key: int) -> TorchTransport:
        node = self._split(("host", socket.gethostname()), key)
        assert node is not None
        return node

    def free(self) -> None:
        """Release the group and the node's shared memory of a split no longer used (by
        every member, as MPI's Comm_free). A Gloo group keeps a thread of its own that
        wakes a hundred times a second however idle the group: kept to shutdown, the
        splits that init() makes and frees cost every rank 300 such wake-ups a second
        through training (BENCHMARKS.md, "freed groups"). The world's group is the
        job's, left to torch."""
        if self._node_memory is not None:
            self._node_memory.close()
            self._node_memory = None
        self._node_memory_tried = True      # freed: no memory is opened again
        if self.group is not dist.group.WORLD and dist.is_initialized():
            dist.destroy_process_group(self.group)
            self.group = None

    def device_group(self, backend: str) -> Any:
        """A c10d process group of this transport's members, in our rank order, on
        ``backend`` ("nccl"; "gloo" for the CPU stand-in of tests/standin), for the GPU
        backend (hvdlite/backends/torch_nccl.py). Only the members call it: it is made
        from the job's store under a prefix rank 0 draws, not through ``new_group``,
        which every process of the world must call in the same order."""
        token = self.bcast(os.urandom(8).hex() if self.rank == 0 else None)
        store = dist.PrefixStore(f"hvdlite/device-group/{token}",
                                 dist.distributed_c10d._get_default_store())
        if backend == "nccl":
            return dist.ProcessGroupNCCL(store, self.rank, self.size)
        if backend == "gloo":
            return dist.ProcessGroupGloo(store, self.rank, self.size)
        raise UsageError(f"rank {self.rank}: no device group on backend {backend!r}; "
                         "known: 'nccl', 'gloo'")

    def lane_channel(self) -> Union[NodeLane, TorchLane]:
        """Where every rank shares the node's memory, segments of the lane's own (they
        carry host data faster than Gloo: a lane over Gloo there trained the MLP at
        0.59x the MPI lane's speed at np=2 and 0.26x at np=4, on 2 cores); otherwise
        a Gloo group of its own."""
        if self._opened_node_memory() is not None:
            memory = self._new_node_memory()
            if memory is not None:
                return NodeLane(memory)
        return TorchLane(self.device_group("gloo"), self.rank)

    def liveness_channel(self) -> StoreChannel:
        # A prefix of the session's own (rank 0's random token): a second init() in
        # this process, or a restarted job on the same store, starts from zero.
        token = self.bcast(os.urandom(8).hex() if self.rank == 0 else None)
        store = dist.distributed_c10d._get_default_store()   # the job's rendezvous store
        return StoreChannel(store, f"hvdlite/{token}", self.rank, self.size)

    def allreduce_array(self, buf: np.ndarray, op: ReduceOp) -> None:
        check_data_op(self.rank, op)
        memory = self._opened_node_memory()
        if memory is not None and memory.reduces(buf.dtype, op):
            memory.allreduce(buf, op)
            return
        if buf.dtype.kind == "c" and op is not ReduceOp.SUM:
            # Gloo sums complex numbers only: the others' arrays, multiplied here in rank
            # order (Min and Max of complex numbers the API refuses before this).
            parts = self._gather_bytes(buf.tobytes(), block)
            arrays = [np.frombuffer(p, dtype=buf.dtype).reshape(buf.shape) for p in parts]
            buf[...] = functools.reduce(np.multiply, arrays)
            return
        wide = _GLOO_WIDER.get(buf.dtype)
        if wide is not None:
            # Gloo has no 16-bit integers nor unsigned ones past 8 bits: reduced wider, then
            # narrowed, which wraps Sum and Product as MPI's reduction of the type does.
            wider = buf.astype(wide)
            self._allreduce(_tensor(wider, self.rank), op)
            buf[...] = wider.astype(buf.dtype)
        elif buf.dtype == np.uint64:
            # As int64: Sum and Product are the same bits; flipping the sign bit maps
            # unsigned order onto signed order for Min and Max.
            signed = buf.view(np.int64)
            flip = op in (ReduceOp.MIN, ReduceOp.MAX)
            if flip:
                signed ^= _SIGN64
            self._allreduce(_tensor(signed, self.rank), op)
            if flip:
                signed ^= _SIGN64
        else:
            self._allreduce(_tensor(buf, self.rank), op)

    def _allreduce(self, tensor: torch.Tensor, op: ReduceOp) -> None:
        TorchPending(self.group.allreduce([tensor], OPTIONS[op]), tensor).wait()

    def broadcast_array(self, buf: np.ndarray, root: int) -> None:
        raw = torch.from_numpy(buf.reshape(-1).view(np.uint8))   # any dtype, as bytes
        TorchPending(dist.broadcast(raw, src=self.members[root], group=self.group,
                                    async_op=True), raw).wait()

    def allgather_array(self, send: np.ndarray, recv: np.ndarray,
                        counts: Sequence[int]) -> None:
        item = send.itemsize
        parts = self._gather_bytes(send.tobytes(), block)
        if [len(p) for p in parts] != [int(c) * item for c in counts]:
            raise HvdliteError(f"rank {self.rank}: allgather counts {list(counts)} do not "
                               f"match the parts sent ({[len(p) // item for p in parts]})")
        recv.reshape(-1).view(np.uint8)[:] = np.frombuffer(b"".join(parts), dtype=np.uint8)

    def alltoall_array(self, send: np.ndarray, send_counts: Sequence[int],
                       recv: np.ndarray, recv_counts: Sequence[int]) -> None:
        """Gloo's all_to_all_single on bytes (so any dtype travels). Its splits are in
        torch's rank order; a set renumbered by its split key sends its parts
        reordered into torch's and puts what arrives back into ours."""
        item = send.itemsize
        out = [int(c) * item for c in send_counts]
        into = [int(c) * item for c in recv_counts]
        if sum(out) != send.nbytes or sum(into) != recv.nbytes:
            raise HvdliteError(f"rank {self.rank}: alltoall counts (send {list(send_counts)}, "
                               f"recv {list(recv_counts)}) do not match the buffers "
                               f"({send.size} and {recv.size} elements)")
        ours_of = sorted(range(self.size), key=lambda r: self._torch_index[r])  # torch -> ours
        sent = _reordered(send.reshape(-1).view(np.uint8), out, ours_of)
        got = np.empty(recv.nbytes, dtype=np.uint8)
        got_tensor, sent_tensor = torch.from_numpy(got), torch.from_numpy(sent)
        TorchPending(dist.all_to_all_single(got_tensor, sent_tensor,
                                            output_split_sizes=[into[r] for r in ours_of],
                                            input_split_sizes=[out[r] for r in ours_of],
                                            group=self.group, async_op=True),
                     got_tensor, sent_tensor).wait()
        target = recv.reshape(-1).view(np.uint8)
        bounds = np.cumsum([0] + [into[r] for r in ours_of])
        where = np.cumsum([0] + into)
        for j, r in enumerate(ours_of):        # torch's j-th part is our rank r's
            target[where[r]: where[r + 1]] = got[bounds[j]: bounds[j + 1]]

    def abort(self, status: int) -> None:
        """End this process: torchrun's agent then stops every other rank of the job."""
        os._exit(status)


def _reordered(raw: np.ndarray, sizes: Sequence[int], order: Sequence[int]) -> np.ndarray:
    """``raw``'s parts (of ``sizes`` bytes, in our rank order) in ``order``: a new,
    contiguous array, which torch may read while the caller's buffer stays untouched."""
    bounds = np.cumsum([0] + list(sizes))
    parts = [raw[bounds[r]: bounds[r + 1]] for r in order]
    return np.concatenate(parts) if parts else raw.copy()


def _tensor(buf: np.ndarray, rank: int) -> torch.Tensor:
    try:
        return torch.from_numpy(buf.reshape(-1))
    except TypeError as error:
        raise HvdliteError(f"rank {rank}: torch cannot reduce {buf.dtype} arrays "
                           f"({error}); reduce a wider type") from error


# -- opening the world (hvdlite.init under torchrun) -------------------------------------------
def launched(environ: Any = None) -> bool:
    """Whether torchrun (torch.distributed.run) started this process."""
    return "TORCHELASTIC_RUN_ID" in (os.environ if environ is None else environ)


def _store_prefix(environ: Any = None) -> str:
    """Where this attempt's workers meet in the store torchrun hands them. The agent's own
    store (TORCHELASTIC_USE_AGENT_STORE=True: a static rendezvous, or c10d's shared one)
    outlives --max-restarts: a restarted worker would read the dead attempt's Gloo
    addresses (connection refused, or a hang), so each attempt gets its own keys. A store
    of the workers' own (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: rank 0 starts it anew at
    every start) holds only this attempt's keys, and there the agents' restart counts may
    differ: a node that joins a running job starts at 0 while the others have restarted."""
    environ = os.environ if environ is None else environ
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return "/hvdlite"
    return f"/hvdlite/attempt_{environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


# Gloo lets go of a tensor a moment after its operation completes; a tensor something
# else holds a view of would be waited on in vain.
_RELEASE_WAIT_S = 2.0
_exit_hook = {"registered": False, "destroys_world": False}


def initialize() -> None:
    """The default process group, over Gloo, from torchrun's variables; one the program
    made itself (any backend) is used as it is, and left to it to tear down."""
    if not dist.is_initialized():
        store, rank, size = next(dist.rendezvous("env://"))
        dist.init_process_group("gloo", store=dist.PrefixStore(_store_prefix(), store),
                                rank=rank, world_size=size)
        _exit_hook["destroys_world"] = True
    if not _exit_hook["registered"]:
        # Registered before init()'s own hook, so atexit runs it after hvdlite's
        # shutdown; whoever made the groups, Gloo's threads must let go of hvdlite's
        # tensors before the interpreter finalizes.
        atexit.register(_at_exit)
        _exit_hook["registered"] = True


def _at_exit() -> None:
    """Destroy the groups if hvdlite made them; then wait until Gloo's threads, which
    outlive them, have let go of every tensor hvdlite gave them (hvdlite/transport/handoff.py).
    In that order: the wait after the last of Gloo's work, the teardown's own too."""
    if _exit_hook["destroys_world"] and dist.is_initialized():
        dist.destroy_process_group()
    HANDOFF.await_released(_RELEASE_WAIT_S)


def world_rank() -> int:
    return dist.get_rank()


def open_world(comm: Any, shared_memory: bool = True) -> TorchTransport:
    if comm is not None:
        raise UsageError(f"rank {dist.get_rank()}: init(comm=...) names MPI ranks or "
                         "communicators; under torchrun hvdlite runs on every rank of the "
                         "job: call hvdlite.init() without comm")
    group = dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    return TorchTransport(group, range(dist.get_world_size()), shared_memory)


def threads_multiple() -> bool:
    return False     # no MPI here; the program's own torch.distributed calls are its own
