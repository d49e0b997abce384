"""A lane (hvdlite/engine/lane.py) through the node's shared memory: the torch
transport's, where every rank shares one host (hvdlite/transport/torch_transport.py).

A lane has segments of its own (``open_node_memory`` once more), so its sums never
interleave with the transport's other allreduces, which run through the first ones
whenever a round agrees on them. Its sums run one after another, in the order they
were started, which is the order every rank starts a lane's buckets in. Each moves
through the steps of hvdlite/transport/node_memory.py, chunk by chunk, but never waits
between them: a test takes the sum at the head of the lane as far as the peers'
arrivals let it, and returns. The engine's thread tests the lane while it serves
(hvdlite/engine/lanes.py), so a bucket's sum overlaps the backward pass with no
negotiation round, as an MPI lane's nonblocking allreduce does.

A reduce-scatter is a sum whose last step copies back this rank's segment only; an
allgather posts each rank's segment where it goes in the whole, and each rank copies
every segment out once all have posted (one arrival a chunk: a rank posts the next
chunk only once it has copied this one, and the halves alternate, so no segment is
overwritten while a peer may still read it).
"""
from __future__ import annotations

import collections
import time
from typing import Callable, Optional, Sequence

import numpy as np

from hvdlite.transport.node_memory import CHECK_S, NodeMemory


class NodeLane:
    """Sums, reduce-scatters and allgathers on segments of their own, started without
    waiting (LaneChannel)."""

    def __init__(self, memory: NodeMemory) -> None:
        self._memory = memory
        self._under_way: collections.deque[NodeOp] = collections.deque()

    def start_sum(self, buf: np.ndarray) -> NodeOp:
        return self._start(NodeSum(self, self._memory.chunks(buf)))

    def start_reduce_scatter(self, buf: np.ndarray, out: np.ndarray,
                             counts: Sequence[int]) -> NodeOp:
        """The sum of ``buf``, of which this rank keeps its segment (``counts``: each
        rank's, in rank order), into ``out``."""
        lo, flat = sum(counts[:self._memory.rank]), buf.reshape(-1)
        hi = lo + counts[self._memory.rank]
        return self._start(NodeSum(self, self._memory.chunks(buf), (lo, hi),
                                   lambda: out.__setitem__(Ellipsis, flat[lo:hi])))

    def start_allgather(self, buf: np.ndarray, out: np.ndarray,
                        counts: Sequence[int]) -> NodeOp:
        """Every rank's ``buf`` (``counts[k]`` elements from rank k) into ``out``, in
        rank order."""
        return self._start(NodeGather(self, self._memory.chunks(out), buf, counts))

    def _start(self, op: NodeOp) -> NodeOp:
        self._under_way.append(op)
        self.advance()
        return op

    def advance(self) -> None:
        """The collectives in the order started, as far as the peers' arrivals let
        them go."""
        under_way = self._under_way
        while under_way and under_way[0].advance(self._memory):
            under_way.popleft()

    def close(self) -> None:
        self._memory.close()


class NodeOp:
    """One collective of a NodeLane (Pending): its chunks (``NodeMemory.chunks``: all of
    one size but the last), how far it got, and ``then``, run once it is complete."""
    __slots__ = ("_lane", "_chunks", "_next", "_views", "_waiting_since", "_next_check",
                 "_then", "done")

    def __init__(self, lane: NodeLane, chunks: list[np.ndarray],
                 then: Optional[Callable[[], None]] = None) -> None:
        self._lane, self._chunks, self._then = lane, chunks, then
        self._next = 0                    # the chunk under way
        self._views: Optional[list[np.ndarray]] = None   # posted (step 1 done)
        self._waiting_since = 0.0         # when this rank found its peers late (0: not)
        self._next_check = 0.0
        self.done = False
        self._end_if_done()

    def Test(self) -> bool:  # noqa: N802 (the Pending protocol's name)
        if not self.done:
            self._lane.advance()
        return self.done

    def advance(self, memory: NodeMemory) -> bool:
        """Steps as far as they go without waiting; True once complete."""
        raise NotImplementedError

    def _within(self, lo: int, hi: int) -> slice:
        """Elements ``lo`` to ``hi`` of the whole, where they fall in the chunk under way
        (chunk-relative; empty where they miss it)."""
        size = self._chunks[self._next].size
        start = self._next * self._chunks[0].size
        return slice(min(max(lo - start, 0), size), min(max(hi - start, 0), size))

    def _next_chunk(self) -> None:
        self._views = None
        self._next += 1
        self._end_if_done()

    def _end_if_done(self) -> None:
        self.done = self._next == len(self._chunks)
        if self.done and self._then is not None:
            self._then()

    def _peers_arrived(self, memory: NodeMemory) -> bool:
        late = memory.late()
        if late:
            self._check(memory, late)
            return False
        self._waiting_since = 0.0
        return True

    def _check(self, memory: NodeMemory, late: list[int]) -> None:
        """A peer that exited fails the collective (PeerLostError) within CHECK_S of its
        being found late; a slow one is the lane's stall check's
        (hvdlite/engine/lane.py)."""
        now = time.monotonic()
        if not self._waiting_since:
            self._waiting_since, self._next_check = now, now + CHECK_S
        elif now >= self._next_check:
            self._next_check = now + CHECK_S
            memory.check_peers(late, now - self._waiting_since)


class NodeSum(NodeOp):
    """An in-place sum; with ``keep`` (lo, hi), only those elements are copied back (a
    reduce-scatter, whose ``then`` takes them)."""
    __slots__ = ("_reduced", "_keep")

    def __init__(self, lane: NodeLane, chunks: list[np.ndarray],
                 keep: Optional[tuple[int, int]] = None,
                 then: Optional[Callable[[], None]] = None) -> None:
        self._reduced = False             # this rank's slice reduced (step 2 done)
        self._keep = keep
        super().__init__(lane, chunks, then)

    def advance(self, memory: NodeMemory) -> bool:
        chunks = self._chunks
        while not self.done:
            chunk = chunks[self._next]
            if self._views is None:
                self._views = memory.post(chunk)
            if not self._peers_arrived(memory):
                return False
            if not self._reduced:
                memory.reduce_slice(self._views, chunk.size, np.add)
                self._reduced = True
                continue
            memory.copy_back(self._views, chunk,
                             slice(None) if self._keep is None else self._within(*self._keep))
            self._reduced = False
            self._next_chunk()
        return True


class NodeGather(NodeOp):
    """An allgather into ``chunks`` (of the whole): each chunk's share of this rank's
    ``send`` posted where it goes, then every rank's copied out."""
    __slots__ = ("_send", "_bounds")

    def __init__(self, lane: NodeLane, chunks: list[np.ndarray], send: np.ndarray,
                 counts: Sequence[int]) -> None:
        self._send = send.reshape(-1)
        ends = np.cumsum([0, *counts]).tolist()
        self._bounds = list(zip(ends[:-1], ends[1:]))     # each rank's, in the whole
        super().__init__(lane, chunks)

    def advance(self, memory: NodeMemory) -> bool:
        chunks = self._chunks
        while not self.done:
            chunk = chunks[self._next]
            shares = [self._within(lo, hi) for lo, hi in self._bounds]
            if self._views is None:
                mine, (first, _) = shares[memory.rank], self._bounds[memory.rank]
                begin = self._next * chunks[0].size + mine.start - first
                self._views = memory.post(self._send[begin:begin + mine.stop - mine.start],
                                          mine.start, chunk.size)
            if not self._peers_arrived(memory):
                return False
            for view, share in zip(self._views, shares):
                chunk[share] = view[share]
            self._next_chunk()
        return True
