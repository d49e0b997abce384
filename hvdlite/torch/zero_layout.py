"""Where each element of a ZeroRedundancyOptimizer's parameters lives (zero.py).

The parameters, in the order of the optimizer's groups, are laid end to end in flat
spaces, one per (dtype, device). Each space is split into one contiguous range per rank
of the process set, as even as can be: the first ``total % size`` ranks hold one
element more. So every element has exactly one owner and the ranks' shares differ by
at most one element per space, whatever the parameters' sizes: one large embedding
is split across ranks like any other run of elements (DeepSpeed's flat partitions;
torch's own ZeroRedundancyOptimizer gives each parameter whole to one rank).

A space travels in chunks of about HVDLITE_BUCKET_BYTES: a chunk's reduce-scatter
gives each rank the part of the chunk in its range (``counts``: zero for most ranks
of a small chunk), and the parts of one rank, chunk after chunk, are its range in
order. The allgather after the step is the same chunks the other way round.
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
    """``start:stop`` of a space, the parameters it overlaps, and each rank's part."""
    __slots__ = ("start", "stop", "positions", "counts", "mine")

    def __init__(self, start: int, stop: int, positions: list[int], counts: list[int],
                 mine: tuple[int, int]) -> None:
        self.start, self.stop, self.positions, self.counts = start, stop, positions, counts
        self.mine = mine        # this rank's part: start:stop in its shard


class Space:
    """One (dtype, device)'s parameters laid end to end, and this rank's range of it."""

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
        # As even as can be with the first ranks one more (reducescatter's own split).
        counts = [self.total // size + (1 if r < self.total % size else 0) for r in range(size)]
        bounds = [0, *itertools.accumulate(counts)]
        self.bounds = bounds
        self.lo, self.hi = bounds[rank], bounds[rank + 1]
        self.chunks = self._chunks(rank, size, chunk_elements)
        self.pieces = self._pieces(max(1, chunk_elements))

    def _pieces(self, chunk_elements: int) -> list[Piece]:
        """This rank's parts of each parameter, cut where chunks end: a piece's gradient
        is then a view of its chunk's reduce-scatter, and its elements one run of the
        rank's part of that chunk."""
        pieces = []
        for position, offset, numel in zip(self.positions, self.offsets, self.numels):
            start, stop = max(offset, self.lo), min(offset + numel, self.hi)
            while start < stop:
                chunk = start // chunk_elements
                end = min(stop, (chunk + 1) * chunk_elements)
                pieces.append(Piece(position, start - offset, end - offset, start - self.lo,
                                    chunk))
                start = end
        return pieces

    def _chunks(self, rank: int, size: int, chunk_elements: int) -> list[Chunk]:
        chunks = []
        for start in range(0, self.total, max(1, chunk_elements)):
            stop = min(start + chunk_elements, self.total)
            counts = [max(0, min(stop, self.bounds[r + 1]) - max(start, self.bounds[r]))
                      for r in range(size)]
            positions = [p for p, offset, numel in zip(self.positions, self.offsets, self.numels)
                         if offset < stop and offset + numel > start]
            begin = max(start, self.lo) - self.lo if counts[rank] else 0
            chunks.append(Chunk(start, stop, positions, counts, (begin, begin + counts[rank])))
        return chunks

    @property
    def shard_size(self) -> int:
        return self.hi - self.lo

    def overlap(self, chunk: Chunk, position: int) -> tuple[slice, slice]:
        """Where parameter ``position`` and ``chunk`` overlap: the slice of the chunk's
        elements, and the slice of the parameter's flattened elements."""
        offset = self.offset_of[position]
        start = max(offset, chunk.start)
        stop = min(offset + self._numel_of[position], chunk.stop)
        return (slice(start - chunk.start, stop - chunk.start),
                slice(start - offset, stop - offset))


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
