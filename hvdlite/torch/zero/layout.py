"""Where each element of a ZeroRedundancyOptimizer's parameters lives (optimizer.py).

The parameters, in the order of the optimizer's groups, are laid end to end in flat
spaces, one per (dtype, device). A space travels in chunks of about
HVDLITE_BUCKET_BYTES, one after another, and each chunk is split between the ranks as
evenly as can be (``segments``, consecutive, rank after rank): its reduce-scatter gives
each rank its own segment, and the allgather after the step is the same chunks the
other way round. A rank's shard is its segments, chunk after chunk. A chunk's one
element more goes to the ranks after the last chunk's, in turn, so the shards differ by
one element at most, whatever the parameters' sizes: one large embedding is split
across ranks like any other run of elements (DeepSpeed's flat partitions; torch's own
ZeroRedundancyOptimizer gives each parameter whole to one rank).

Chunks one after another are what backward makes one after another (overlap.py:
the last chunk is complete first). Even segments are what MPICH moves fast: a chunk cut
instead at the ranks' own contiguous ranges lay in one or two of them, and the
nonblocking reduce-scatter and allgather of such skewed parts took 20x the time of
even ones (11.6 M float32 in two chunks at 4 ranks: 0.7 s an allgather, against 36 ms).
"""
from __future__ import annotations

import itertools
import math
from typing import Sequence

import torch

IN_FLIGHT = 2          # chunks reduced or gathered at once, each a chunk of memory


class Piece:
    """A part of one parameter that this rank owns, within one chunk: ``start:stop`` of
    the parameter's flattened elements, at ``offset`` in this rank's shard of the
    space; chunk ``chunk`` of the space carries it."""
    __slots__ = ("position", "start", "stop", "offset", "chunk")

    def __init__(self, position: int, start: int, stop: int, offset: int, chunk: int) -> None:
        self.position, self.start, self.stop, self.offset = position, start, stop, offset
        self.chunk = chunk


class Chunk:
    """``start:stop`` of a space split between the ranks (``segments``: start, stop in
    the space, rank by rank, consecutive; ``counts``: their lengths), the parameters it
    overlaps, in order, and this rank's part: start:stop in its shard."""
    __slots__ = ("start", "stop", "segments", "positions", "counts", "mine")

    def __init__(self, segments: list[tuple[int, int]], positions: list[int],
                 mine: tuple[int, int]) -> None:
        self.segments, self.positions = segments, positions
        self.start, self.stop = segments[0][0], segments[-1][1]
        self.counts = [stop - start for start, stop in segments]
        self.mine = mine        # this rank's part: start:stop in its shard


class Space:
    """One (dtype, device)'s parameters laid end to end, its chunks and this rank's
    pieces of it."""

    def __init__(self, index: int, dtype: torch.dtype, device: torch.device,
                 positions: list[int], numels: list[int], rank: int, size: int,
                 chunk_elements: int) -> None:
        self.index, self.dtype, self.device = index, dtype, device
        self.positions = positions
        self.offsets = [0, *itertools.accumulate(numels)][:len(numels)]
        self.numels = numels
        self.offset_of = dict(zip(positions, self.offsets))
        self._numel_of = dict(zip(positions, numels))
        self.total = sum(numels)
        self.chunks, shares = self._chunks(rank, size, max(1, chunk_elements))
        self.shard_size = shares[rank]
        self.pieces = self._pieces(rank)

    def _chunks(self, rank: int, size: int, run: int) -> tuple[list[Chunk], list[int]]:
        """Consecutive chunks of ``run`` elements, each split evenly (its one element more
        to the ranks after the last chunk's, in turn); and every rank's shard size."""
        chunks, shares, turn = [], [0] * size, 0
        for start in range(0, self.total, run):
            stop = min(start + run, self.total)
            base, extra = divmod(stop - start, size)
            counts = [base + (1 if (r - turn) % size < extra else 0) for r in range(size)]
            turn = (turn + extra) % size
            bounds = list(itertools.accumulate(counts, initial=start))
            segments = list(zip(bounds[:-1], bounds[1:]))
            positions = [p for p, offset, numel in zip(self.positions, self.offsets, self.numels)
                         if offset < stop and offset + numel > start]
            chunks.append(Chunk(segments, positions, (shares[rank], shares[rank] + counts[rank])))
            shares = [have + count for have, count in zip(shares, counts)]
        return chunks, shares

    def _pieces(self, rank: int) -> list[Piece]:
        """This rank's parts of each parameter, chunk by chunk: a piece's gradient is then
        a view of its chunk's reduce-scatter, and its elements one run of the rank's
        segment of that chunk."""
        pieces = []
        for k, chunk in enumerate(self.chunks):
            first, last = chunk.segments[rank]
            for position in chunk.positions:
                offset = self.offset_of[position]
                start, stop = max(offset, first), min(offset + self._numel_of[position], last)
                if start < stop:
                    pieces.append(Piece(position, start - offset, stop - offset,
                                        chunk.mine[0] + start - first, k))
        return pieces

    def overlap(self, chunk: Chunk, position: int) -> list[tuple[int, slice, slice]]:
        """Where parameter ``position`` and ``chunk`` overlap, segment by segment: the
        segment's rank, the slice of the chunk's elements, and the slice of the
        parameter's flattened elements."""
        offset = self.offset_of[position]
        end, runs, at = offset + self._numel_of[position], [], 0
        for r, (first, last) in enumerate(chunk.segments):
            start, stop = max(offset, first), min(end, last)
            if start < stop:
                runs.append((r, slice(at + start - first, at + stop - first),
                             slice(start - offset, stop - offset)))
            at += last - first
        return runs


def lay_out(params: Sequence[torch.Tensor], rank: int, size: int,
            chunk_bytes: int) -> list[Space]:
    """The spaces of ``params`` (positions are indices into it), in order of first
    appearance of each (dtype, device)."""
    kinds: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for position, param in enumerate(params):
        kinds.setdefault((param.dtype, param.device), []).append(position)
    spaces = []
    for index, ((dtype, device), positions) in enumerate(kinds.items()):
        itemsize = torch.empty((), dtype=dtype).element_size()
        spaces.append(Space(index, dtype, device, positions,
                            [math.prod(params[p].shape) for p in positions], rank, size,
                            max(1, chunk_bytes // itemsize)))
    return spaces
