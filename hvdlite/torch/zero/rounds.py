"""A ZeroRedundancyOptimizer's spaces that are not on lanes (lanes.py: another
dtype or device, a transport without them, HVDLITE_LANE=0): each chunk's
reduce-scatter and allgather negotiated as any collective is, and only the chunks
that held a gradient on some rank (the flags' round has agreed which)."""
from __future__ import annotations

import collections
from typing import Any, Sequence

import torch

from hvdlite.api import collectives
from hvdlite.api.process_set import ProcessSet
from hvdlite.reduce_op import ReduceOp
from hvdlite.torch.adapter import TORCH
from hvdlite.torch.mpi_ops import synchronize
from hvdlite.torch.zero.layout import IN_FLIGHT, Space



def reduce_scatter(what: str, spaces: Sequence[Space], flats: Sequence[torch.Tensor],
                   anywhere: Sequence[bool],
                   process_set: ProcessSet) -> dict[tuple[int, int], torch.Tensor]:
    """Each chunk's gradients averaged into its owners' parts: this rank's, by (space,
    chunk)."""
    parts: dict[tuple[int, int], torch.Tensor] = {}
    started: collections.deque[tuple[tuple[int, int], int]] = collections.deque()
    for space, flat in zip(spaces, flats):
        for k, chunk in enumerate(space.chunks):
            if not any(anywhere[p] for p in chunk.positions):
                continue
            # In flight, each takes a chunk's copy in the engine: a few at a time.
            started.append(((space.index, k), collectives.reducescatter_async(
                TORCH, flat[chunk.start:chunk.stop],
                name=f"{what}.grads.{space.index}.{k}", op=int(ReduceOp.AVERAGE),
                process_set=process_set, splits=chunk.counts)))
            if len(started) == IN_FLIGHT:
                key, handle = started.popleft()
                parts[key] = synchronize(handle)
    for key, handle in started:
        parts[key] = synchronize(handle)
    return parts


def allgather(what: str, spaces: Sequence[Space],
              by_chunk: dict[tuple[int, int], list[torch.Tensor]],
              params: Sequence[torch.Tensor], anywhere: Sequence[bool],
              process_set: ProcessSet) -> None:
    """Every chunk that held a stepped parameter, from its owners to every rank: each
    rank sends its part of the chunk straight from the parameter where one piece is
    all of it, else the pieces joined. At most IN_FLIGHT chunks are under way: each
    brings a whole chunk, and all of them at once would be the model's size again."""
    started: collections.deque[tuple[Space, Any, int]] = collections.deque()
    for space in spaces:
        for k, chunk in enumerate(space.chunks):
            if not any(anywhere[p] for p in chunk.positions):
                continue
            mine = by_chunk.get((space.index, k), [])
            part = (mine[0] if len(mine) == 1 else torch.cat(mine) if mine else
                    torch.empty(0, dtype=space.dtype, device=space.device))
            started.append((space, chunk, collectives.allgather_async(
                TORCH, part, f"{what}.params.{space.index}.{k}", process_set)))
            if len(started) == IN_FLIGHT:
                _gathered(params, *started.popleft())
    while started:
        _gathered(params, *started.popleft())


def _gathered(params: Sequence[torch.Tensor], space: Space, chunk: Any, handle: int) -> None:
    flat = synchronize(handle)
    for position in chunk.positions:
        for _, in_chunk, in_param in space.overlap(chunk, position):
            params[position].view(-1)[in_param] = flat[in_chunk]
