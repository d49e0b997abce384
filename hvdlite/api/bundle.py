"""Grouped allreduces of small CPU tensors, submitted as one request.

Why this is not the gradient reducer (hvdlite.reducer), though both pack tensors
into one flat buffer with the adapter's ``pack``/``unpack``: a user's grouped call
is one-off. Its tensors, names and shapes may change from call to call, so it cannot
have persistent buckets agreed by an exchange; a bundle is agreed per call by
negotiation itself (its shapes are in the descriptor), at no extra round trip.

Each tensor submitted alone costs about 10 us of Python on the user thread and
as much again on the engine (a request, a handle, a negotiation entry, a fused
slot, a completion): 200 small gradients took ten times one reduction of the
same bytes. A bundle packs a group's small tensors into one array on the calling
thread (one C call); the engine negotiates and reduces it as one tensor, and the
results are views of it (or are copied back into the tensors, for the in-place
forms). Large tensors (``BUNDLED_BELOW`` bytes and more) still go one by one:
the engine reduces those in their own memory, where a bundle would copy them.

Every rank must bundle the same tensors, so the decision reads only what every
rank must agree on anyway: the op, the number of tensors, their dtype, device and
size. Where those differ between ranks (a bug in the caller), the bundle carries
the name of its first tensor, so negotiation reports the mismatch under that name
on every rank. The descriptor lists each bundled shape (``parts``), compared
across ranks like a tensor's shape.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence

import numpy as np

from hvdlite.api import runtime
from hvdlite.api.adapter import NUMPY, TensorAdapter
from hvdlite.api.process_set import ProcessSet
from hvdlite.api.submission import (ARGUMENT_ERRORS, Call, GroupHandle, Input, check_reduction,
                                    check_scale, inplace_output, reduce_op, returning, submit_group)
from hvdlite.negotiation.requests import Kind, dtype_name
from hvdlite.reduce_op import ReduceOp

BUNDLED_BELOW = 1 << 20   # the engine's default direct threshold: larger ones go alone


def small_items(adapter: TensorAdapter, tensors: Sequence[Any], op: Optional[int],
                average: Optional[bool]) -> dict[int, Input]:
    """The tensors to bundle, by index, converted: CPU tensors of one dtype below
    BUNDLED_BELOW bytes, if there are two or more, for any op but Adasum (which is
    not elementwise); else none. Never raises: the per-tensor path names what is
    wrong with an argument."""
    try:
        if len(tensors) < 2 or reduce_op(op, average) is ReduceOp.ADASUM:
            return {}
        small: dict[int, Input] = {}
        dtypes: set[str] = set()
        for index, tensor in enumerate(tensors):
            # A GPU tensor's conversion records a CUDA event: decide before converting.
            if not adapter.is_tensor(tensor) or adapter.device(tensor) != "cpu":
                return {}
            if adapter.nbytes(tensor) < BUNDLED_BELOW:
                source = small[index] = Input(adapter, tensor, "grouped_allreduce")
                dtypes.add(dtype_name(source.array.dtype))
            else:        # large ones go alone; no conversion here (TensorFlow's copies)
                dtypes.add(adapter.dtype_name(tensor))
    except ARGUMENT_ERRORS:
        return {}
    return small if len(small) >= 2 and len(dtypes) == 1 else {}


def submit(adapter: TensorAdapter, tensors: Sequence[Any], sources: Sequence[Input],
           name: str, process_set: Optional[ProcessSet], inplace: bool, op: Optional[int],
           average: Optional[bool], prescale_factor: float, postscale_factor: float) -> int:
    """Submit ``tensors`` (converted: ``sources``) as one allreduce named ``name``;
    synchronizing its handle returns one result per tensor, in order. A bad argument
    marks the bundle failed on this rank (so every rank raises) and is raised here."""
    what = "grouped_allreduce_" if inplace else "grouped_allreduce"
    call = Call(Kind.ALLREDUCE, name, process_set)
    try:
        reduction = reduce_op(op, average)
        for source in sources:
            check_reduction(source, reduction, name)
        targets = [_target(source, what, adapter.writable(t)) for source, t in
                   zip(sources, tensors)] if inplace else None
        prescale = check_scale(prescale_factor, "prescale_factor")
        postscale = check_scale(postscale_factor, "postscale_factor")
    except ARGUMENT_ERRORS as error:
        call.mark(error)
        raise
    shapes = tuple(source.array.shape for source in sources)
    sizes = [source.array.size for source in sources]
    dtype = sources[0].array.dtype
    flat = runtime.RUNTIME.outputs.empty((sum(sizes),), dtype)
    NUMPY.pack([source.array for source in sources], flat)
    finish = _unbundle(adapter, tensors, targets, shapes)
    return call.submit(flat, flat, None, finish, op=int(reduction), prescale=prescale,
                       postscale=postscale, dtype=dtype_name(dtype), shape=flat.shape,
                       parts=shapes)


def _target(source: Input, what: str, writable: bool) -> Any:
    """The memory an in-place result is copied into: the caller's own, strides kept
    (``inplace_output`` also refuses read-only and self-overlapping targets)."""
    output, writeback = inplace_output(source, what, writable)
    return output if writeback is None else writeback


def _unbundle(adapter: TensorAdapter, tensors: Sequence[Any], targets: Optional[list[Any]],
              shapes: tuple[tuple[int, ...], ...]) -> Callable[[Any], list]:
    inplace = targets is not None
    finishes = [returning(adapter, tensor, inplace) for tensor in tensors]

    def finish(flat: Any) -> list[Any]:
        results = NUMPY.unpack(flat, shapes)
        if targets is not None:
            for target, piece in zip(targets, results):
                np.copyto(target, piece)
            results = targets
        return [r if f is None else f(r) for r, f in zip(results, finishes)]
    return finish


def grouped_allreduce(adapter: TensorAdapter, submit_one: Callable[..., int],
                      tensors: Sequence[Any], base: str, process_set: Optional[ProcessSet],
                      inplace: bool, small: dict[int, Input], **kwargs: Any) -> GroupHandle:
    """The bundle of ``small`` (named after its first tensor) and the other tensors
    one by one, named ``<base>.<i>``; the handle's results are in the tensors' order.
    If a submission is refused, the ones after it are marked failed on this rank,
    so the peers fail them too."""
    tensors = list(tensors)
    alone = [i for i in range(len(tensors)) if i not in small]
    first = f"{base}.{next(iter(small))}"
    bundled = functools.partial(
        submit, adapter, [tensors[i] for i in small], list(small.values()), first,
        process_set, inplace, kwargs.get("op"), kwargs.get("average"),
        kwargs.get("prescale_factor", 1.0), kwargs.get("postscale_factor", 1.0))
    submissions = [(first, bundled)] + [
        (f"{base}.{i}", functools.partial(submit_one, tensors[i], name=f"{base}.{i}",
                                          process_set=process_set, **kwargs))
        for i in alone]
    handles = submit_group("grouped_allreduce", Kind.ALLREDUCE, process_set, submissions)

    def in_order(results: list[Any]) -> list[Any]:
        ordered: list[Any] = [None] * len(tensors)
        for index, result in zip(small, results[0]):
            ordered[index] = result
        for index, result in zip(alone, results[1:]):
            ordered[index] = result
        return ordered
    return GroupHandle(handles, in_order)
