"""Fusion: which agreed allreduces share one reduction, and the persistent
buffers they are packed into (one per device). Planning is pure and
unit-tested without MPI."""
from __future__ import annotations

import mmap
from typing import Any, Callable, Hashable, Sequence

import numpy as np

from hvdlite.backends.base import offsets, widened_dtype
from hvdlite.negotiation.requests import Response
from hvdlite.reduce_op import ReduceOp

__all__ = ["DEFAULT_DIRECT_BYTES", "FusionBuffers", "fusion_key", "offsets", "plan_groups"]

DEFAULT_DIRECT_BYTES = 1 << 20   # HVDLITE_DIRECT_THRESHOLD's default; see hvdlite.config
ReductionDtype = Callable[[Response], np.dtype]


def _host_reduction(response: Response) -> np.dtype:
    return widened_dtype(response.dtype)


def fusion_key(response: Response) -> Hashable:
    d = response.desc
    return (d.device, d.dtype, d.op, d.prescale, d.postscale, response.joined)


def plan_groups(responses: Sequence[Response], threshold: int,
                direct_bytes: int = DEFAULT_DIRECT_BYTES,
                reduced_dtype: ReductionDtype = _host_reduction) -> list[list[Response]]:
    """Group allreduce responses with the same key into buffers of <= threshold bytes.

    Groups keep the order in which their first member was agreed, and members
    keep agreed order, so every rank derives the same plan. A tensor larger
    than the threshold, or of at least ``direct_bytes`` already in its
    reduction dtype, forms a group of its own (reduced in place, no copies); so
    does every Adasum tensor.
    """
    if len(responses) == 1:
        return [list(responses)]
    open_groups: dict[Hashable, tuple[list[Response], list[int]]] = {}
    order: list[list[Response]] = []
    for response in responses:
        wide = reduced_dtype(response)
        nbytes = response.count * wide.itemsize
        # Adasum's coefficients are per tensor: one vector per reduction, never fused.
        alone = nbytes >= direct_bytes and wide == response.dtype
        if alone or response.desc.op == ReduceOp.ADASUM:
            order.append([response])
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


class FusionBuffers:
    """One persistent byte buffer per device, viewed as whatever dtype a group
    reduces in.

    Allocated once at the largest size asked for, and pre-faulted, so
    steady-state steps never page-fault a fresh temporary (the cause of
    MPI_Allreduce's slump at 64 MiB measured on this machine). ``xp_for``
    gives the device's array namespace (NumPy, CuPy). The host buffer is its
    own memory map, not malloc's: malloc keeps a freed block of a few MiB in
    its heap, so only a map gives the memory back when ``release_host`` lets
    the buffer go.
    """

    def __init__(self, xp_for: Callable[[str], Any]) -> None:
        self._xp_for = xp_for
        self._raw: dict[str, Any] = {}

    def view(self, device: str, dtype: np.dtype, count: int) -> Any:
        nbytes = count * np.dtype(dtype).itemsize
        raw = self._raw.get(device)
        if raw is None or nbytes > raw.nbytes:
            raw = self._raw[device] = (
                _prefaulted_host_bytes(nbytes) if device == "cpu"
                else self._xp_for(device).zeros(nbytes, dtype=np.uint8))
        return raw[:nbytes].view(dtype)

    def release_host(self) -> None:
        """Let the host buffer go; the next fused reduction makes a new one.

        Safe from any thread: the engine thread holds its own reference to a
        buffer it is using (and so do the views of work in flight), so the map
        is unmapped only once nothing uses it."""
        self._raw.pop("cpu", None)

    @property
    def host_bytes(self) -> int:
        raw = self._raw.get("cpu")
        return 0 if raw is None else raw.nbytes


def _prefaulted_host_bytes(nbytes: int) -> np.ndarray:
    """``nbytes`` zero bytes in a fresh anonymous map, every page touched."""
    raw = np.frombuffer(mmap.mmap(-1, max(1, nbytes)), dtype=np.uint8)[:nbytes]
    raw.fill(0)      # a map's pages are zeros already: writing them faults them in now
    return raw
