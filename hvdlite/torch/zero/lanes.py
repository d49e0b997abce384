"""A ZeroRedundancyOptimizer's space on lanes (hvdlite/engine/lane.py): each step's
reduce-scatters and allgathers start at once, with no negotiation round, where the
transport's lanes have them (MPI; on the torch transport the node's shared memory, or
Gloo) and the space is float32 or float64 on the CPU.

Two lanes per space, opened once per layout: one reduce-scatters each chunk of the
gradients, one allgathers each chunk of the stepped parameters, every chunk every
step, in order. A chunk no rank had a gradient for still goes (zeros in, the
parameters unchanged out): which chunks go cannot depend on this step's gradients,
since no round agrees on it.

Each rank's segment of a reduce-scatter is its part of the chunk, then the flags of
the chunk's parameters (1 for a dense gradient on this rank, size + 1 for a sparse
one), then the check words; summed, the flags say on every rank which parameters had
a gradient anywhere, and whether any was sparse, where a round of its own said it
before. An allgather's segment is the rank's part, then its check words, which carry
a failed step: every rank then fails, none hangs.
"""
from __future__ import annotations

import collections
import functools
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from hvdlite.api import lane
from hvdlite.api.lane import CHECK_WORDS as W
from hvdlite.api.process_set import ProcessSet
from hvdlite.api.submission import synchronize
from hvdlite.torch.adapter import dtype_name
from hvdlite.torch.zero.layout import IN_FLIGHT, Space


DENSE, SPARSE = 1.0, 2.0       # a parameter's flag, where it had a gradient (else 0)


def flag(grad: Optional[torch.Tensor]) -> float:
    return 0.0 if grad is None else SPARSE if grad.is_sparse else DENSE


def carried(space: Space) -> bool:
    return lane.carries(dtype_name(space.dtype), space.device.type)


class SpaceLanes:
    """One space's lanes, and the buffers its chunks travel in."""

    def __init__(self, what: str, space: Space, params: Sequence[torch.Tensor], rank: int,
                 size: int, process_set: ProcessSet) -> None:
        self.space, self.rank, self.size, self.what = space, rank, size, what
        self.params = params         # every parameter of the layout, by position
        dtype = dtype_name(space.dtype)
        self.dtype = np.dtype(dtype)
        chunks = space.chunks
        # Reduce-scattered last chunk first, as backward makes the gradients (overlap.py).
        self.order = list(range(len(chunks)))[::-1]
        self._reduce_segments = [[c + len(chunk.positions) + W for c in chunk.counts]
                                 for chunk in chunks]
        self._gather_segments = [[c + W for c in chunk.counts] for chunk in chunks]
        in_order = [self._reduce_segments[k] for k in self.order]
        self._grads = lane.Lane(f"{what}.grads.{space.index}", [sum(s) for s in in_order],
                                dtype, process_set, lane.LaneKind.REDUCE_SCATTER, in_order)
        self._params = lane.Lane(f"{what}.params.{space.index}",
                                 [sum(s) for s in self._gather_segments], dtype, process_set,
                                 lane.LaneKind.ALLGATHER, self._gather_segments)
        self.opened = self._grads.opened and self._params.opened
        largest = max((max(sum(r), sum(g) + g[rank]) for r, g in zip(
            self._reduce_segments, self._gather_segments)), default=0)
        self._buffers = [np.empty(largest, self.dtype) for _ in range(IN_FLIGHT)]
        self._plans = [self._plan(k) for k in range(len(chunks))]
        # Under way, oldest first: each one's handle, and what to do with it once done.
        self._in_flight: collections.deque[tuple[int, Callable[[], None]]] = collections.deque()
        self._error: Optional[BaseException] = None    # the first, raised once all are done
        self._turns = 0          # collectives started: whose turn each buffer is
        self._received: dict[int, np.ndarray] = {}

    def _plan(self, k: int) -> list[tuple[int, int, int, int]]:
        """Where chunk ``k``'s gathered segments go: (from, to) in the allgather's output,
        the parameter, and where in its flattened elements."""
        chunk, plan = self.space.chunks[k], []
        for position in chunk.positions:
            for r, in_chunk, in_param in self.space.overlap(chunk, position):
                plan.append((in_chunk.start + r * W, in_chunk.stop + r * W, position,
                             in_param.start))
        return plan

    def reduce(self, flat: torch.Tensor, step: int) -> list[np.ndarray]:
        """Every chunk of ``flat`` summed and averaged into this rank's part, now (see
        ``finish_reduce``)."""
        for k in self.order:
            self.start_reduce(k, flat, step)
        return self.finish_reduce()

    def start_reduce(self, k: int, flat: torch.Tensor, step: int) -> None:
        """Start chunk ``k``'s reduce-scatter: its segments of ``flat`` copied into a
        buffer, each followed by the marks of the chunk's parameters' gradients, once
        a buffer is free. Chunks go in ``order``, every one in each backward pass."""
        buf = self._free_buffer()
        chunk, segments = self.space.chunks[k], self._reduce_segments[k]
        marks = self._marks(chunk.positions)
        source, send, at = flat.numpy(), buf[:sum(segments)], 0
        for (begin, end), count, segment in zip(chunk.segments, chunk.counts, segments):
            send[at:at + count] = source[begin:end]
            send[at + count:at + count + len(marks)] = marks
            at += segment
        out = np.empty(segments[self.rank], self.dtype)
        handle = self._grads.submit(send, chunk.counts[self.rank], 1.0 / self.size, step,
                                    f"{self.what}.grads.{self.space.index}.{k}", (), out=out)
        self._in_flight.append((handle, functools.partial(self._received.__setitem__, k, out)))

    def finish_reduce(self) -> list[np.ndarray]:
        """Wait for every reduce-scatter started; per chunk, in index order, the latest
        one's part: this rank's averaged elements, the summed flags of the chunk's
        parameters, then the check words."""
        try:
            self._finish_all()
            return [self._received[k] for k in range(len(self.space.chunks))]
        finally:
            self._received = {}

    def _marks(self, positions: list[int]) -> np.ndarray:
        """A mark per gradient: none 0, dense 1, sparse size + 1, so that their sum over
        the ranks tells whether any rank had one, and whether any was sparse."""
        grads = [self.params[p].grad for p in positions]
        return np.array([0.0 if g is None else self.size + 1.0 if g.is_sparse else DENSE
                         for g in grads], self.dtype)

    def flags(self, parts: list[np.ndarray], found: list[float]) -> list[float]:
        """``found`` (a flag per parameter) with this space's from the summed marks in
        ``parts`` (``finish_reduce``'s): every rank's answer alike."""
        found = list(found)
        for chunk, part in zip(self.space.chunks, parts):
            marks = part[chunk.counts[self.rank]:][:len(chunk.positions)]
            for position, mark in zip(chunk.positions, marks.tolist()):
                found[position] = SPARSE if mark > self.size else DENSE if mark else 0.0
        return found

    def gather(self, mine: Callable[[int], Sequence[torch.Tensor]], step: int,
               failed: bool) -> None:
        """Every chunk's parts, from their owners to every rank, into the parameters; this
        rank's part of chunk k is ``mine(k)``, joined. ``failed``: this rank's step
        failed, and every rank's allgathers fail (this rank raises its own error)."""
        for k, segments in enumerate(self._gather_segments):
            buf = self._free_buffer()
            whole = sum(segments)
            out, send, at = buf[:whole], buf[whole:whole + segments[self.rank]], 0
            for tensor in mine(k):
                n = tensor.numel()
                torch.from_numpy(send[at:at + n]).copy_(tensor)
                at += n
            handle = self._params.submit(send, 0, 1.0, step,
                                         f"{self.what}.params.{self.space.index}.{k}",
                                         ("step",), 0 if failed else None, out=out)
            self._in_flight.append((handle, functools.partial(self._land, k, out)))
        self._finish_all()

    def _land(self, k: int, out: np.ndarray) -> None:
        """Chunk ``k``'s gathered segments into the parameters."""
        gathered = torch.from_numpy(out)
        for lo, hi, position, at in self._plans[k]:
            self.params[position].view(-1)[at:at + hi - lo] = gathered[lo:hi]

    def _free_buffer(self) -> np.ndarray:
        """The next buffer, once free: at most IN_FLIGHT collectives are under way, each
        in a buffer of its own (each holds a chunk: all at once would be the model's
        size again)."""
        if len(self._in_flight) == IN_FLIGHT:
            self._finish_one()
        buf = self._buffers[self._turns % IN_FLIGHT]
        self._turns += 1
        return buf

    def _finish_one(self) -> None:
        """The oldest collective waited for, and handed on unless one failed before."""
        handle, done = self._in_flight.popleft()
        try:
            synchronize(handle)
        except BaseException as failed:           # noqa: BLE001 (raised by _finish_all)
            self._error = self._error or failed
            return
        if self._error is None:
            done()

    def _finish_all(self) -> None:
        """Every collective under way waited for, even after one failed (a buffer is not
        reused while the engine may write it), then the first error raised."""
        while self._in_flight:
            self._finish_one()
        error, self._error = self._error, None
        if error is not None:
            raise error
