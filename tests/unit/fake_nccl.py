"""A stand-in for ``cupy.cuda.nccl`` over tests/unit/fake_cupy.py's memory: one
communicator per rank thread, whose calls meet through a shared slot per
communicator, as tests/unit/fake_comm.py's MPI collectives do.

Faithful: a communicator is made by every rank of the id (it blocks until all
came) and refuses two ranks on one GPU of one host; NCCL reads ``count``
elements of the NCCL datatype at the pointer it is given, on the
communicator's GPU and on a stream of that GPU; calls between groupStart and
groupEnd run together at groupEnd, at most MAX_GROUP_OPS of them (older NCCL's
limit); every rank must issue the same collectives in the same order, and sends
must match receives; Reduce writes only the root's receive buffer, Broadcast
reads only the root's send buffer; ncclAvg exists from NCCL 2.10 (it
premultiplies floats by 1/n and divides integers after the sum) and, as measured
on NCCL 2.28.9 with one rank, out of place it leaves the output's elements past
the last multiple of 16 unwritten (AVG_TAIL). Not: reductions run in rank order,
not in NCCL's ring order, and each group reads all its inputs before writing any
output.

The ranks meet in ``_launch`` through their communicator's world, whose
``exchange(rank, item)`` returns every rank's item: a barrier between threads
here, an MPI allgather in tests/mpi/gpu_standin.py (which also swaps the memory
model through ``use_memory``). What crosses it is plain data (``Sent`` records
and arrays), so either transport can carry it.
"""
from __future__ import annotations

import itertools
import sys
import threading
import types
from typing import Any, Callable, NamedTuple, Optional

import ml_dtypes
import numpy as np
import pytest

from tests.unit.fake_cupy import _local, current_device, hostname, resolve, stream_of

TIMEOUT = 10.0
MAX_GROUP_OPS = 2048          # operations one group call accepts (older NCCL releases)
AVG_TAIL = 16                 # ncclAvg out of place on one rank writes whole blocks of this

NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN, NCCL_AVG = 0, 1, 2, 3, 4
_NCCL_TYPES = {0: np.dtype(np.int8), 1: np.dtype(np.uint8), 2: np.dtype(np.int32),
               3: np.dtype(np.uint32), 4: np.dtype(np.int64), 5: np.dtype(np.uint64),
               6: np.dtype(np.float16), 7: np.dtype(np.float32), 8: np.dtype(np.float64),
               9: np.dtype(ml_dtypes.bfloat16)}
_FLOAT_TYPES = {6, 7, 8, 9}
_UFUNCS = {NCCL_SUM: np.add, NCCL_PROD: np.multiply, NCCL_MAX: np.maximum,
           NCCL_MIN: np.minimum, NCCL_AVG: np.add}


class NcclError(RuntimeError):
    pass


class _State:
    def __init__(self, version: int) -> None:
        self.lock = threading.Lock()
        self.version = version
        self.worlds: dict[tuple, _NcclWorld] = {}
        self.next_uid = itertools.count(1)
        self.groups: list[tuple[int, int]] = []     # (rank, operations) per launch
        self.communicators: list[NcclCommunicator] = []
        self.unique_ids: list[tuple[str, int]] = []  # (host, GPU) of each get_unique_id call


_state = _State(0)


def state() -> _State:
    return _state


def get_version() -> int:
    return _state.version


def get_unique_id() -> tuple:
    """A fresh id; who asked is recorded (NCCL's call starts the bootstrap root of
    a communicator there, which waits for its ranks: one id per communicator)."""
    with _state.lock:
        _state.unique_ids.append((hostname(), current_device()))
        serial = next(_state.next_uid).to_bytes(8, "little") + bytes(120)
    return tuple(np.frombuffer(serial, np.int8).tolist())    # 128 C chars, as CuPy's


class _NcclWorld:
    def __init__(self, size: int) -> None:
        self.size = size
        self._slots: list[Any] = [None] * size
        self._barrier = threading.Barrier(size)

    def exchange(self, rank: int, item: Any) -> list[Any]:
        self._slots[rank] = item
        self._barrier.wait(TIMEOUT)
        items = list(self._slots)
        self._barrier.wait(TIMEOUT)
        return items

    def abort(self) -> None:
        self._barrier.abort()


_memory: dict[str, Callable[[int, int, int], np.ndarray]] = {"resolve": resolve}


def use_memory(resolve_bytes: Callable[[int, int, int], np.ndarray]) -> None:
    """Read and write device memory through ``resolve_bytes(ptr, nbytes, device)``
    (fake_cupy's fake addresses by default)."""
    _memory["resolve"] = resolve_bytes


class Sent(NamedTuple):
    """What one rank tells the others of one of its operations."""
    kind: str
    count: int
    datatype: int
    op: int
    root: int
    peer: int

    def signature(self) -> tuple:
        return (self.kind, self.count, self.datatype, self.op, self.root)


class _Op:
    def __init__(self, comm: "NcclCommunicator", kind: str, count: int, datatype: int,
                 stream: int, send: int = 0, recv: int = 0, op: int = -1,
                 root: int = -1, peer: int = -1) -> None:
        if datatype not in _NCCL_TYPES:
            raise NcclError(f"invalid datatype {datatype}")
        if op != -1 and (op not in _UFUNCS or op == NCCL_AVG and _state.version < 21000):
            raise NcclError(f"invalid reduction {op} (NCCL {_state.version})")
        for who in (root, peer):
            if who != -1 and not 0 <= who < comm.size:
                raise NcclError(f"invalid rank {who} of {comm.size}")
        self.kind, self.count, self.datatype, self.op = kind, int(count), datatype, op
        self.root, self.peer, self.send, self.recv = root, peer, send, recv
        self.stream = stream_of(stream, comm.device)
        self.dtype = _NCCL_TYPES[datatype]

    def sent(self) -> Sent:
        return Sent(self.kind, self.count, self.datatype, self.op, self.root, self.peer)

    def read(self, rank: int, device: int) -> Optional[np.ndarray]:
        """What this rank contributes (NCCL reads the root's buffer only, in a Broadcast)."""
        if self.kind == "recv" or self.kind == "broadcast" and rank != self.root:
            return None
        raw = _memory["resolve"](self.send, self.count * self.dtype.itemsize, device)
        return raw.view(self.dtype).copy()

    def write(self, values: np.ndarray, device: int, upto: Optional[int] = None) -> None:
        """Write ``values`` (their first ``upto`` elements only, if given)."""
        target = _memory["resolve"](self.recv, self.count * self.dtype.itemsize, device)
        written = values.astype(self.dtype, copy=False)[:upto].view(np.uint8)
        target[:written.size] = written


class NcclCommunicator:
    def __init__(self, ndev: int, commId: tuple, rank: int) -> None:  # noqa: N803
        if not isinstance(commId, tuple) or len(commId) != 128:
            raise NcclError("invalid unique id")
        with _state.lock:
            world = _state.worlds.setdefault(commId, _NcclWorld(ndev))
        if world.size != ndev or not 0 <= rank < ndev:
            world.abort()
            raise NcclError(f"rank {rank} of {ndev} in a communicator of {world.size}")
        self.rank, self.size, self.device, self._world = rank, ndev, current_device(), world
        places = world.exchange(rank, (hostname(), self.device))   # blocks until all came
        if None in places:
            raise NcclError("two ranks gave one rank number")
        if len(set(places)) < ndev:
            raise NcclError("ncclInvalidUsage: Duplicate GPU detected")
        self.alive = True
        with _state.lock:
            _state.communicators.append(self)

    def destroy(self) -> None:
        self.alive = False

    def _issue(self, op: _Op) -> None:
        if not self.alive:
            raise NcclError("communicator destroyed")
        group = getattr(_local, "group", None)
        if group is None:
            _launch(self, [op])
        else:
            group.append((self, op))

    def allReduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int,  # noqa: N802
                  op: int, stream: int) -> None:
        self._issue(_Op(self, "allreduce", count, datatype, stream, sendbuf, recvbuf, op=op))

    def reduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int,
               root: int, stream: int) -> None:
        self._issue(_Op(self, "reduce", count, datatype, stream, sendbuf, recvbuf, op=op,
                        root=root))

    def broadcast(self, sendbuff: int, recvbuff: int, count: int, datatype: int, root: int,
                  stream: int) -> None:
        self._issue(_Op(self, "broadcast", count, datatype, stream, sendbuff, recvbuff,
                        root=root))

    def send(self, sendbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        self._issue(_Op(self, "send", count, datatype, stream, send=sendbuf, peer=peer))

    def recv(self, recvbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        self._issue(_Op(self, "recv", count, datatype, stream, recv=recvbuf, peer=peer))


def groupStart() -> None:  # noqa: N802
    _local.depth = getattr(_local, "depth", 0) + 1
    if _local.depth == 1:
        _local.group = []


def groupEnd() -> None:  # noqa: N802
    depth = getattr(_local, "depth", 0)
    if depth == 0:
        raise NcclError("ncclInvalidUsage: groupEnd without groupStart")
    _local.depth = depth - 1
    if depth == 1:
        group, _local.group = _local.group, None
        for comm in dict.fromkeys(c for c, _ in group):
            _launch(comm, [op for c, op in group if c is comm])


class _Failed(NamedTuple):
    """A rank's group that failed before it was exchanged (its message)."""
    message: str


def _launch(comm: NcclCommunicator, ops: list[_Op]) -> None:
    """Run one rank's share of a group call: every rank's operations meet at once.
    A rank whose operations cannot be read still takes part in the exchange, so
    every rank fails at once (over MPI nothing else would wake the others)."""
    failure: Optional[BaseException] = None
    try:
        if len(ops) > MAX_GROUP_OPS:
            raise NcclError(f"{len(ops)} operations in one group (at most {MAX_GROUP_OPS})")
        mine: Any = [(op.sent(), op.read(comm.rank, comm.device)) for op in ops]
    except Exception as error:        # noqa: BLE001 (re-raised below, after the exchange)
        failure, mine = error, _Failed(f"{type(error).__name__}: {error}")
    with _state.lock:
        _state.groups.append((comm.rank, len(ops)))
    everyone = comm._world.exchange(comm.rank, mine)
    if failure is not None:
        raise failure
    failed = [(rank, item.message) for rank, item in enumerate(everyone)
              if isinstance(item, _Failed)]
    if failed:
        raise NcclError(f"rank {failed[0][0]}'s group failed: {failed[0][1]}")
    _run_collectives(comm, ops, everyone)
    _run_receives(comm, ops, everyone)


def _run_collectives(comm: NcclCommunicator, ops: list[_Op],
                     everyone: list[list[tuple[Sent, Any]]]) -> None:
    collectives = [[(sent, data) for sent, data in items if sent.kind not in ("send", "recv")]
                   for items in everyone]
    signatures = {tuple(sent.signature() for sent, _ in c) for c in collectives}
    if len(signatures) != 1:
        raise NcclError(f"ranks issued different collectives: {sorted(signatures)}")
    _check_pairs(everyone)
    mine = [op for op in ops if op.kind not in ("send", "recv")]
    for index, op in enumerate(mine):
        inputs = [c[index][1] for c in collectives]
        if op.kind == "broadcast":
            op.write(inputs[op.root], comm.device)
        elif op.kind == "allreduce" or op.kind == "reduce" and comm.rank == op.root:
            op.write(_reduce(inputs, op), comm.device, _written(comm, op))


def _written(comm: NcclCommunicator, op: _Op) -> Optional[int]:
    """How many elements NCCL writes (None: all): ncclAvg out of place on a one-rank
    communicator stops at the last whole block of AVG_TAIL (NCCL 2.28.9, measured)."""
    if op.op == NCCL_AVG and comm.size == 1 and op.send != op.recv:
        return op.count // AVG_TAIL * AVG_TAIL
    return None


def _run_receives(comm: NcclCommunicator, ops: list[_Op],
                  everyone: list[list[tuple[Sent, Any]]]) -> None:
    received: dict[int, int] = {}                 # receives from each peer so far
    for op in ops:
        op.stream.log.append(("nccl", op.kind, op.count))
        if op.kind == "recv":
            nth = received[op.peer] = received.get(op.peer, -1) + 1
            match, data = [(sent, d) for sent, d in everyone[op.peer]
                           if sent.kind == "send" and sent.peer == comm.rank][nth]
            if (match.count, match.datatype) != (op.count, op.datatype):
                raise NcclError(f"rank {op.peer} sends {match.count} of type {match.datatype}, "
                                f"rank {comm.rank} receives {op.count} of {op.datatype}")
            op.write(data, comm.device)


def _check_pairs(everyone: list[list[tuple[Sent, Any]]]) -> None:
    """Each rank's sends to a peer are that peer's receives from it, one for one."""
    unmatched: dict[tuple[int, int], int] = {}
    for rank, items in enumerate(everyone):
        for sent, _ in items:
            pair = (rank, sent.peer) if sent.kind == "send" else (sent.peer, rank)
            if sent.kind in ("send", "recv"):
                unmatched[pair] = unmatched.get(pair, 0) + (1 if sent.kind == "send" else -1)
    if any(unmatched.values()):
        raise NcclError(f"sends and receives do not match: {unmatched}")


def _reduce(inputs: list[np.ndarray], op: _Op) -> np.ndarray:
    """Every rank's values reduced in rank order, in the datatype itself."""
    size = len(inputs)
    if op.op == NCCL_AVG and op.datatype in _FLOAT_TYPES:
        scale = np.array(1.0 / size).astype(op.dtype)
        inputs = [(values * scale).astype(op.dtype) for values in inputs]
    total = inputs[0].copy()
    for values in inputs[1:]:
        _UFUNCS[op.op](total, values, out=total)
    if op.op == NCCL_AVG and op.datatype not in _FLOAT_TYPES:
        total = (np.sign(total) * (np.abs(total) // size)).astype(op.dtype)   # C's truncation
    return total



_NAMES = ["NCCL_SUM", "NCCL_PROD", "NCCL_MAX", "NCCL_MIN", "NCCL_AVG", "NcclError",
          "NcclCommunicator", "get_version", "get_unique_id", "groupStart", "groupEnd"]
_TYPE_NAMES = {"NCCL_INT8": 0, "NCCL_UINT8": 1, "NCCL_INT32": 2, "NCCL_UINT32": 3,
               "NCCL_INT64": 4, "NCCL_UINT64": 5, "NCCL_FLOAT16": 6, "NCCL_FLOAT32": 7,
               "NCCL_FLOAT64": 8, "NCCL_BFLOAT16": 9}


def module(monkeypatch: pytest.MonkeyPatch, version: int) -> types.ModuleType:
    """A fresh ``cupy.cuda.nccl`` of NCCL ``version`` (get_version's number)."""
    this = sys.modules[__name__]
    monkeypatch.setattr(this, "_state", _State(version))
    nccl = types.ModuleType("cupy.cuda.nccl")
    nccl.__dict__.update({name: getattr(this, name) for name in _NAMES}, **_TYPE_NAMES)
    return nccl
