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
"""
from __future__ import annotations

import collections
import time
from typing import Optional

import numpy as np

from hvdlite.transport.node_memory import CHECK_S, NodeMemory


class NodeLane:
    """In-place sums on segments of their own, started without waiting (LaneChannel)."""

    def __init__(self, memory: NodeMemory) -> None:
        self._memory = memory
        self._sums: collections.deque[NodeSum] = collections.deque()

    def start_sum(self, buf: np.ndarray) -> NodeSum:
        started = NodeSum(self, self._memory.chunks(buf))
        self._sums.append(started)
        self.advance()
        return started

    def advance(self) -> None:
        """The sums in the order started, as far as the peers' arrivals let them go."""
        sums = self._sums
        while sums and sums[0].advance(self._memory):
            sums.popleft()

    def close(self) -> None:
        self._memory.close()


class NodeSum:
    """One sum of a NodeLane (Pending): its chunks, and how far the first one got."""
    __slots__ = ("_lane", "_chunks", "_next", "_views", "_reduced", "_waiting_since",
                 "_next_check", "done")

    def __init__(self, lane: NodeLane, chunks: list[np.ndarray]) -> None:
        self._lane, self._chunks = lane, chunks
        self._next = 0                    # the chunk under way
        self._views: Optional[list[np.ndarray]] = None   # posted (step 1 done)
        self._reduced = False             # this rank's slice reduced (step 2 done)
        self._waiting_since = 0.0         # when this rank found its peers late (0: not)
        self._next_check = 0.0
        self.done = not chunks

    def Test(self) -> bool:  # noqa: N802 (the Pending protocol's name)
        if not self.done:
            self._lane.advance()
        return self.done

    def advance(self, memory: NodeMemory) -> bool:
        """Steps as far as they go without waiting; True once the sum is complete."""
        chunks = self._chunks
        while not self.done:
            chunk = chunks[self._next]
            if self._views is None:
                self._views = memory.post(chunk)
            late = memory.late()
            if late:
                self._check(memory, late)
                return False
            self._waiting_since = 0.0
            if not self._reduced:
                memory.reduce_slice(self._views, chunk.size, np.add)
                self._reduced = True
                continue
            memory.copy_back(self._views, chunk)
            self._views, self._reduced = None, False
            self._next += 1
            self.done = self._next == len(chunks)
        return True

    def _check(self, memory: NodeMemory, late: list[int]) -> None:
        """A peer that exited fails the sum (PeerLostError) within CHECK_S of its being
        found late; a slow one is the lane's stall check's (hvdlite/engine/lane.py)."""
        now = time.monotonic()
        if not self._waiting_since:
            self._waiting_since, self._next_check = now, now + CHECK_S
        elif now >= self._next_check:
            self._next_check = now + CHECK_S
            memory.check_peers(late, now - self._waiting_since)
