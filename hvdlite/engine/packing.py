"""Getting tensors into and out of the buffer a backend reduces: a fused group
packed into the fusion buffer and unpacked after, a lone tensor reduced in its own
output, a tensor's memory as bytes for the backends that move bytes.

The executor (executor.py) calls these on the engine thread for every agreed
collective, so they are plain functions it imports by name: no object, no extra
lookup per call. Written against ``xp``, the array namespace of the tensors'
device (NumPy on the CPU, CuPy on a GPU).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from hvdlite.engine import fusion
from hvdlite.engine.scaling import Scale, scale
from hvdlite.negotiation.requests import ReduceOp, Request
from hvdlite.reduce_op import identity

__all__ = ["as_bytes", "direct_target", "is_in_place", "pack_group", "pack_one", "unpack_group"]


def direct_target(requests: Sequence[Optional[Request]], dtype: np.dtype,
                  wide: np.dtype) -> Any:
    """A lone tensor already in its reduction dtype is reduced in its own output."""
    if len(requests) != 1 or requests[0] is None or dtype != wide:
        return None
    output = requests[0].output
    return output.reshape(-1) if output is not None and output.flags.c_contiguous else None


def is_in_place(xp: Any, source: Any, buf: Any) -> bool:
    """Whether a lone tensor is already in its output. The two are either the same
    memory or separate allocations, so NumPy's bounds check decides it; CuPy's
    shares_memory would run a kernel over every element, so compare pointers."""
    if xp is np:
        return np.may_share_memory(source, buf)
    return source.data.ptr == buf.data.ptr


def pack_one(xp: Any, request: Request, buf: Any, prescale: float,
             out_of_place: bool) -> Any:
    """Get a lone tensor's input into its output ``buf``, scaled; or, where the
    backend reduces out of place and nothing needs scaling, return the input for it
    to read (a copy into a fresh output costs as much as a fast allreduce)."""
    source = request.array
    if source is request.output or is_in_place(xp, source.reshape(-1), buf):
        scale(xp, buf, prescale)
    elif prescale != 1.0:
        xp.multiply(source.reshape(-1), prescale, out=buf, casting="unsafe")
    elif out_of_place:
        return source.reshape(-1)
    else:
        buf[...] = source.reshape(-1)
    return None


def pack_group(xp: Any, requests: Sequence[Optional[Request]], counts: Sequence[int],
               buf: Any, prescale: float, op: ReduceOp) -> None:
    """Copy a fused group's inputs into the fusion buffer ``buf``, back to back, scaled."""
    if all(request is not None for request in requests):
        xp.concatenate([r.array.reshape(-1) for r in requests], out=buf, casting="unsafe")
        scale(xp, buf, prescale)
        return
    # This rank has joined: it contributes the op's identity (zeros for Sum), written
    # after the prescale, which would turn Min's +inf into -inf for a negative factor.
    for request, start, count in zip(requests, fusion.offsets(counts), counts):
        buf[start:start + count] = 0 if request is None else request.array.reshape(-1)
    scale(xp, buf, prescale)
    fill = identity(op, buf.dtype)
    if fill != 0:
        for request, start, count in zip(requests, fusion.offsets(counts), counts):
            if request is None:
                buf[start:start + count] = fill


def unpack_group(xp: Any, requests: Sequence[Optional[Request]], counts: Sequence[int],
                 buf: Any, postscale: Scale) -> None:
    """Scale the reduced fusion buffer ``buf`` and copy each part into its request's
    output, cast to the output's dtype (a rank that has joined has no output)."""
    postscale.apply(xp, buf)
    for request, start, count in zip(requests, fusion.offsets(counts), counts):
        if request is not None:
            xp.copyto(request.output, buf[start:start + count].reshape(request.output.shape),
                      casting="unsafe")


def as_bytes(array: Any) -> Any:
    """A contiguous array's memory as bytes (inputs and outputs are contiguous by
    the time they reach the executor: the API stages non-contiguous ones)."""
    return array.reshape(-1).view(np.uint8)
