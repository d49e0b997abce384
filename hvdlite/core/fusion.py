"""Fusion: which agreed allreduces share one reduction, and the persistent
buffer they are packed into. Planning is pure and unit-tested without MPI."""
from __future__ import annotations

from typing import Hashable, Sequence

import ml_dtypes
import numpy as np

from hvdlite.core.requests import Response

# MPICH rejects bfloat16 SUM and some Open MPI builds silently return garbage
# for it, so half types are reduced as float32 (packed with a widening copy).
_WIDENED = {np.dtype(np.float16): np.dtype(np.float32),
            np.dtype(ml_dtypes.bfloat16): np.dtype(np.float32)}


def reduction_dtype(dtype: np.dtype) -> np.dtype:
    return _WIDENED.get(np.dtype(dtype), np.dtype(dtype))


# Tensors at least this large are reduced alone, in place in their own memory.
# Fusion exists to amortize per-op latency over small tensors; for a 1 MiB tensor
# that latency is already small next to the two memcpys (in and out of the fusion
# buffer) that fusing would cost. Measured on the MLP benchmark: packing 7.4 MB of
# gradients cost ~1.5 ms of CPU per step, more than the whole reduction.
DIRECT_BYTES = 1 << 20


def fusion_key(response: Response) -> Hashable:
    d = response.desc
    return (d.dtype, d.op, d.prescale, d.postscale, response.joined)


def plan_groups(responses: Sequence[Response], threshold: int) -> list[list[Response]]:
    """Group allreduce responses with the same key into buffers of <= threshold bytes.

    Groups keep the order in which their first member was agreed, and members
    keep agreed order, so every rank derives the same plan. A tensor larger
    than the threshold, or of at least DIRECT_BYTES, forms a group of its own.
    """
    if len(responses) == 1:
        return [list(responses)]
    open_groups: dict[Hashable, tuple[list[Response], list[int]]] = {}
    order: list[list[Response]] = []
    for response in responses:
        nbytes = _reduced_nbytes(response)
        if nbytes >= DIRECT_BYTES and reduction_dtype(response.dtype) == response.dtype:
            order.append([response])     # a group of one: reduced in place, no copies
            continue
        key = fusion_key(response)
        current = open_groups.get(key)
        if current is not None and current[1][0] + nbytes <= threshold:
            current[0].append(response)
            current[1][0] += nbytes
            continue
        fresh: list[Response] = [response]
        open_groups[key] = (fresh, [nbytes])
        order.append(fresh)
    return order


def _reduced_nbytes(response: Response) -> int:
    return response.count * reduction_dtype(response.dtype).itemsize


def offsets(sizes: Sequence[int]) -> list[int]:
    """Start offset of each tensor in a packed buffer."""
    starts, total = [], 0
    for size in sizes:
        starts.append(total)
        total += size
    return starts


class FusionBuffer:
    """One persistent byte buffer, viewed as whatever dtype a group reduces in.

    Allocated once at the largest size asked for, and pre-faulted, so steady-state
    steps never page-fault a fresh temporary (the cause of MPI_Allreduce's slump
    at 64 MiB measured on this machine).
    """

    def __init__(self) -> None:
        self._raw = np.empty(0, dtype=np.uint8)

    def view(self, dtype: np.dtype, count: int) -> np.ndarray:
        nbytes = count * np.dtype(dtype).itemsize
        if nbytes > self._raw.nbytes:
            self._raw = np.zeros(nbytes, dtype=np.uint8)
        return self._raw[:nbytes].view(dtype)
