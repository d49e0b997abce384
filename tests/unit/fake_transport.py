"""The in-process transport: threads as ranks, the second implementation of
hvdlite/transport/base.py (MPI is the first), held to the same conformance checks
(tests/transport_conformance.py).

Collectives are matched by their position in each rank's sequence of calls on a
group (MPI's rule: every rank calls a group's collectives in the same order); a
started one completes once every rank of the group has posted its part, so the
non-blocking ones (the negotiation round, the awaited gather and bcast) really are:
``Test`` is true only then. Objects travel pickled, so each rank gets its own copy
as under MPI. Its ``kind`` is MPI unless the test asks for another (``run_transports``'s
``kind``); as an MPI transport's, its ``comm`` is a tests/unit/fake_comm.ThreadComm over
the same ranks, the communicator the host backends' unit tests run on.
"""
from __future__ import annotations

import array
import collections
import pickle
import threading
import time
from typing import Any, Callable, Hashable, Optional, Sequence

import numpy as np

from hvdlite.reduce_op import ReduceOp
from hvdlite.transport.base import Await, TransportKind, check_data_op
from tests.unit.fake_comm import ThreadComm, ThreadWorld, run_threads

TIMEOUT = 10.0
_PING, _VERDICT = "ping", "verdict"
_UFUNCS = {ReduceOp.SUM: np.add, ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum,
           ReduceOp.PRODUCT: np.multiply}


class FakeTransportError(Exception):
    """A collective that cannot complete: a rank never came, or parts do not match."""


class Hub:
    """What the ranks of one group share."""

    def __init__(self, size: int, hosts: Sequence[str], broken: threading.Event,
                 kind: TransportKind = TransportKind.MPI) -> None:
        self.size, self.hosts, self.broken, self.kind = size, list(hosts), broken, kind
        self.cond = threading.Condition()
        self.ops: dict[int, list[Any]] = {}          # sequence number -> posted parts
        self.taken: dict[int, int] = collections.Counter()
        self.children: dict[Hashable, Hub] = {}
        self.inboxes = [collections.deque() for _ in range(size)]   # liveness messages
        self.comm_world = ThreadWorld(size)
        self.aborts: list[tuple[int, int]] = []

    def child(self, key: Hashable, hosts: Sequence[str]) -> "Hub":
        with self.cond:
            if key not in self.children:
                self.children[key] = Hub(len(hosts), hosts, self.broken, self.kind)
            return self.children[key]


class FakePending:
    """One rank's part in a started collective; ``finish(parts)`` runs once, on the
    first ``Test`` that finds every part posted."""

    def __init__(self, hub: Hub, seq: int, finish: Callable[[list[Any]], None]) -> None:
        self._hub, self._seq, self._finish = hub, seq, finish
        self.done = False

    def Test(self) -> bool:  # noqa: N802 (the Pending protocol's name)
        if self.done:
            return True
        hub = self._hub
        if hub.broken.is_set():
            raise FakeTransportError("another rank failed")
        with hub.cond:
            parts = hub.ops[self._seq]
            if any(p is _MISSING for p in parts):
                return False
            hub.taken[self._seq] += 1
            if hub.taken[self._seq] == hub.size:     # the last reader frees the slot
                del hub.ops[self._seq], hub.taken[self._seq]
        self._finish(list(parts))
        self.done = True
        return True

    def wait(self) -> None:
        deadline = time.monotonic() + TIMEOUT
        while not self.Test():
            if time.monotonic() > deadline:
                raise FakeTransportError(f"collective {self._seq} never completed")
            time.sleep(1e-4)


_MISSING = object()


class FakeRound:
    def __init__(self, transport: "ThreadTransport", vector: array.array) -> None:
        self._t, self._vector = transport, vector

    def start(self) -> FakePending:
        def finish(parts: list[Any]) -> None:
            words = [np.frombuffer(p, dtype=np.uint64) for p in parts]
            np.frombuffer(self._vector, dtype=np.uint64)[:] = np.bitwise_and.reduce(words)
        return self._t._post(self._vector.tobytes(), finish)

    def free(self) -> None:
        pass


class FakeChannel:
    def __init__(self, hub: Hub, rank: int) -> None:
        self._hub, self._rank = hub, rank

    def ping(self, ranks: Sequence[int]) -> None:
        for rank in ranks:
            self._hub.inboxes[rank].append((self._rank, _PING, None))

    def drain(self) -> tuple[set[int], list[tuple[int, str]]]:
        inbox = self._hub.inboxes[self._rank]
        heard: set[int] = set()
        verdicts: list[tuple[int, str]] = []
        while inbox:
            source, tag, text = inbox.popleft()
            heard.add(source)
            if tag == _VERDICT:
                verdicts.append((source, text))
        return heard, verdicts

    def tell(self, ranks: Sequence[int], text: str) -> None:
        for rank in ranks:
            self._hub.inboxes[rank].append((self._rank, _VERDICT, text))


class ThreadTransport:
    name = label = "threads"
    lost_rank_wait = "the threads would wait for the lost rank"
    failures: tuple[type[BaseException], ...] = (FakeTransportError,)
    idle_tick_s = 0.1

    def __init__(self, hub: Hub, rank: int) -> None:
        self.hub, self.rank, self.size, self.kind = hub, rank, hub.size, hub.kind
        self.comm = ThreadComm(hub.comm_world, rank)
        self._seq = 0

    # -- matching ------------------------------------------------------------------
    def _post(self, part: Any, finish: Callable[[list[Any]], None]) -> FakePending:
        seq, self._seq = self._seq, self._seq + 1
        hub = self.hub
        with hub.cond:
            parts = hub.ops.setdefault(seq, [_MISSING] * hub.size)
            parts[self.rank] = part
        return FakePending(hub, seq, finish)

    def _exchange(self, part: Any) -> list[Any]:
        result: list[Any] = []
        self._post(part, result.extend).wait()
        return result

    # -- the protocol ------------------------------------------------------------------
    def band_round(self, vector: array.array) -> FakeRound:
        return FakeRound(self, vector)

    def allgather(self, obj: Any) -> list[Any]:
        return [pickle.loads(p) for p in self._exchange(pickle.dumps(obj))]

    def bcast(self, obj: Any, root: int = 0) -> Any:
        parts = self._exchange(pickle.dumps(obj) if self.rank == root else None)
        return pickle.loads(parts[root])

    def gather_awaited(self, obj: Any, wait: Await) -> Optional[list[Any]]:
        result: list[Any] = []
        wait([self._post(pickle.dumps(obj), result.extend)])
        return [pickle.loads(p) for p in result] if self.rank == 0 else None

    def bcast_awaited(self, obj: Any, wait: Await) -> Any:
        result: list[Any] = []
        wait([self._post(pickle.dumps(obj) if self.rank == 0 else None, result.extend)])
        return pickle.loads(result[0])

    def _split(self, color: Optional[Hashable], key: int) -> Optional["ThreadTransport"]:
        token = self._seq                     # the same on every rank: names the new group
        entries = self._exchange((color, key))
        if color is None:
            return None
        members = [r for _, r in sorted((k, r) for r, (c, k) in enumerate(entries)
                                        if c == color)]
        hub = self.hub.child((token, color), [self.hub.hosts[r] for r in members])
        return ThreadTransport(hub, members.index(self.rank))

    def dup(self) -> "ThreadTransport":
        twin = self._split(0, self.rank)
        assert twin is not None
        return twin

    def split(self, color: Optional[int], key: int) -> Optional["ThreadTransport"]:
        return self._split(color, key)

    def split_node(self, key: int) -> "ThreadTransport":
        node = self._split(("host", self.hub.hosts[self.rank]), key)
        assert node is not None
        return node

    def free(self) -> None:
        pass

    def lane_channel(self) -> "FakeLane":
        return FakeLane(self.dup())

    def liveness_channel(self) -> FakeChannel:
        return FakeChannel(self.dup().hub, self.rank)   # a context of its own, as MPI's Dup

    def allreduce_array(self, buf: np.ndarray, op: ReduceOp) -> None:
        check_data_op(self.rank, op)
        parts = self._exchange(buf.copy())
        if any(p.dtype != buf.dtype or p.shape != buf.shape for p in parts):
            raise FakeTransportError(f"rank {self.rank}: ranks reduce different buffers")
        result = parts[0].copy()
        for part in parts[1:]:
            _UFUNCS[op](result, part, out=result)
        buf[...] = result

    def broadcast_array(self, buf: np.ndarray, root: int) -> None:
        buf[...] = self._exchange(buf.copy() if self.rank == root else None)[root]

    def allgather_array(self, send: np.ndarray, recv: np.ndarray,
                        counts: Sequence[int]) -> None:
        parts = self._exchange(send.copy())
        if [p.size for p in parts] != list(counts) or recv.size != sum(counts):
            raise FakeTransportError(f"rank {self.rank}: counts {list(counts)} do not match")
        recv[...] = np.concatenate(parts)

    def alltoall_array(self, send: np.ndarray, send_counts: Sequence[int],
                       recv: np.ndarray, recv_counts: Sequence[int]) -> None:
        bounds = np.cumsum([0] + [int(c) for c in send_counts])
        pieces = [send[bounds[r]: bounds[r + 1]].copy() for r in range(self.size)]
        mine = [part[self.rank] for part in self._exchange(pieces)]
        if [p.size for p in mine] != [int(c) for c in recv_counts]:
            raise FakeTransportError(f"rank {self.rank}: recv counts {list(recv_counts)} "
                                     f"do not match those sent ({[p.size for p in mine]})")
        recv[...] = np.concatenate(mine) if mine else recv

    def abort(self, status: int) -> None:
        self.hub.aborts.append((self.rank, status))


class FakeLane:
    """A lane on a group of its own: a sum posted now, summed on the first ``Test``
    that finds every rank's part (mismatched parts: the error MPI would give)."""

    def __init__(self, transport: ThreadTransport) -> None:
        self._transport = transport
        self.closed = False

    def start_sum(self, buf: np.ndarray) -> FakePending:
        self._open()

        def finish(parts: list[Any]) -> None:
            if any(p.dtype != buf.dtype or p.shape != buf.shape for p in parts):
                raise FakeTransportError(f"rank {self._transport.rank}: ranks sum "
                                         "different buffers on a lane")
            buf[...] = np.sum(parts, axis=0, dtype=buf.dtype)
        return self._transport._post(buf.copy(), finish)

    def start_reduce_scatter(self, buf: np.ndarray, out: np.ndarray,
                             counts: Sequence[int]) -> FakePending:
        self._open()
        rank = self._transport.rank
        begin = sum(counts[:rank])

        def finish(parts: list[Any]) -> None:
            if any(p.shape != buf.shape for p in parts) or out.size != counts[rank]:
                raise FakeTransportError(f"rank {rank}: ranks reduce-scatter different "
                                         "buffers on a lane")
            out[...] = np.sum(parts, axis=0, dtype=buf.dtype)[begin:begin + out.size]
        return self._transport._post(buf.copy(), finish)

    def start_allgather(self, buf: np.ndarray, out: np.ndarray,
                        counts: Sequence[int]) -> FakePending:
        self._open()
        rank = self._transport.rank

        def finish(parts: list[Any]) -> None:
            if [p.size for p in parts] != list(counts) or out.size != sum(counts):
                raise FakeTransportError(f"rank {rank}: ranks allgather different "
                                         "buffers on a lane")
            out[...] = np.concatenate(parts)
        return self._transport._post(buf.copy(), finish)

    def _open(self) -> None:
        if self.closed:
            raise FakeTransportError(f"rank {self._transport.rank}: a collective on a "
                                     "closed lane")

    def close(self) -> None:
        self.closed = True


def run_transports(size: int, work: Callable[[ThreadTransport], Any],
                   hosts: Optional[Sequence[str]] = None,
                   make: Callable[[Hub, int], ThreadTransport] = ThreadTransport,
                   kind: TransportKind = TransportKind.MPI) -> list[Any]:
    """``work(transport)`` on every rank of a fresh world, a thread each; results in
    rank order. Any rank's exception is raised once every thread has ended (the others
    fail fast: a broken world fails their waits)."""
    hub = Hub(size, hosts or ["vm"] * size, threading.Event(), kind)
    results, errors = run_threads(size, lambda rank: work(make(hub, rank)), hub.broken.set)
    if errors:
        first = next((e for e in errors if not isinstance(e, FakeTransportError)), errors[0])
        raise first
    return results
