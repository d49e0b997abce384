"""Recycled memory for the outputs of ``out = allreduce(x)`` on the CPU.

A fresh output of tens of MiB is a fresh ``mmap`` (glibc maps every allocation
above 32 MiB anew): the reduction then page-faults on every 4 KiB of it, and the
kernel zeroes each page first, which on this kind of machine costs as much as a
fast allreduce of the data. A training loop drops last step's output as it
receives this step's, so the same blocks come round again.

A block is free when nothing but the pool refers to it: an output array and
every view of it (a torch tensor made by ``torch.from_numpy``, a slice) keep
their base block alive, so the reference count says when the user is done,
with no finalizer and no cooperation from the caller.
"""
from __future__ import annotations

import sys
import threading

import numpy as np

# Below this an allocation is cheap (glibc reuses heap chunks): not worth pooling.
MIN_POOLED_BYTES = 1 << 20


def _references(blocks: list[np.ndarray], index: int) -> int:
    return sys.getrefcount(blocks[index])


# What _references says of a block only the pool holds, measured rather than assumed:
# how the interpreter counts a call's own references differs between versions.
_FREE = _references([np.empty(1)], 0)


class OutputPool:
    """Blocks of at least MIN_POOLED_BYTES; idle blocks total at most ``capacity``."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._blocks: list[np.ndarray] = []     # most recently used last
        self._lock = threading.Lock()           # user threads may allocate at once

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """An uninitialised array of ``shape`` and ``dtype``, on recycled memory when a
        fitting block is free (no larger than twice the request: nothing wasted)."""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if self.capacity <= 0 or nbytes < MIN_POOLED_BYTES:
            return np.empty(shape, dtype=dtype)
        with self._lock:
            block = self._take(nbytes)
            if block is None:
                block = np.empty(nbytes, dtype=np.uint8)
                self._blocks.append(block)
                self._trim()
        return block[:nbytes].view(dtype).reshape(shape)

    def _free(self, index: int) -> bool:
        return _references(self._blocks, index) <= _FREE

    def _take(self, nbytes: int) -> np.ndarray | None:
        for i in range(len(self._blocks)):
            if nbytes <= self._blocks[i].nbytes <= 2 * nbytes and self._free(i):
                block = self._blocks.pop(i)
                self._blocks.append(block)
                return block
        return None

    def _trim(self) -> None:
        """Forget the least recently used free blocks beyond the capacity (blocks still
        in use are the user's memory, not the pool's overhead)."""
        idle = [i for i in range(len(self._blocks)) if self._free(i)]
        excess = sum(self._blocks[i].nbytes for i in idle) - self.capacity
        dropped = set()
        for i in idle:
            if excess <= 0:
                break
            excess -= self._blocks[i].nbytes
            dropped.add(i)
        self._blocks = [b for i, b in enumerate(self._blocks) if i not in dropped]

    def idle_bytes(self) -> int:
        with self._lock:
            return sum(self._blocks[i].nbytes for i in range(len(self._blocks))
                       if self._free(i))
