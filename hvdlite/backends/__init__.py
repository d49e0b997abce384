"""How bytes move. Each backend reduces a contiguous buffer in place over a
communicator; the engine picks one per reduction (HVDLITE_ALLREDUCE)."""
from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np
from mpi4py import MPI

from hvdlite.reduce_op import ReduceOp


class ReductionBackend(Protocol):
    name: str

    def allreduce(self, comm: MPI.Comm, buf: np.ndarray, op: ReduceOp) -> None:
        """Reduce ``buf`` (1-D, contiguous) in place across ``comm``."""

    def reducescatter(self, comm: MPI.Comm, buf: np.ndarray, counts: Sequence[int],
                      out: np.ndarray, op: ReduceOp) -> None:
        """Reduce ``buf`` across ``comm``; rank r's slice (``counts[r]`` elements,
        in rank order) lands in ``out``. ``buf`` may be clobbered."""


def segment_bounds(counts: Sequence[int]) -> list[tuple[int, int]]:
    """[start, end) of consecutive segments of the given lengths."""
    bounds, start = [], 0
    for count in counts:
        bounds.append((start, start + count))
        start += count
    return bounds


def even_counts(total: int, parts: int) -> list[int]:
    """Split ``total`` into ``parts`` near-equal counts, the first ones larger."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]
