"""The collectives on any framework's tensors, through its adapter (see
``submission`` for the checks, names and error markers every call goes through)."""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence

import numpy as np

from hvdlite.api import bundle, runtime
from hvdlite.api.adapter import TensorAdapter
from hvdlite.api.process_set import ProcessSet
from hvdlite.api.submission import (ARGUMENT_ERRORS, Call, GroupHandle, Input, check_adasum,
                                    check_reduction, check_root, check_scale, inplace_output,
                                    reduce_op, returning, set_ranks, submit_group, synchronize)
from hvdlite.engine.devices import array_namespace
from hvdlite.errors import UsageError
from hvdlite.negotiation.requests import Kind
from hvdlite.reduce_op import ReduceOp

# -- the collectives on one adapter's tensors ------------------------------------------------
def _fresh_output(source: Input) -> Any:
    if source.device == "cpu":
        return runtime.RUNTIME.outputs.empty(source.array.shape, source.array.dtype)
    return array_namespace(source.device).empty_like(source.array)


def allreduce_async(adapter: TensorAdapter, tensor: Any, average: Optional[bool] = None,
                    name: Optional[str] = None, op: Optional[int] = None,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: Optional[ProcessSet] = None, inplace: bool = False) -> int:
    call = Call(Kind.ALLREDUCE, name, process_set, "allreduce_" if inplace else None)
    try:
        reduction = reduce_op(op, average)
        source = Input(adapter, tensor, "allreduce_" if inplace else "allreduce")
        check_reduction(source, reduction, call.name)
        if reduction is ReduceOp.ADASUM:
            check_adasum(source, call.set_size, call.name)
        if inplace:
            output, writeback = inplace_output(source, "allreduce_", adapter.writable(tensor))
        else:
            output, writeback = _fresh_output(source), None
        # Checked only when given: a lone op after idle pays for every call it makes.
        prescale = (1.0 if prescale_factor == 1.0 else
                    check_scale(prescale_factor, "prescale_factor"))
        postscale = (1.0 if postscale_factor == 1.0 else
                     check_scale(postscale_factor, "postscale_factor"))
    except ARGUMENT_ERRORS as error:
        call.mark(error)
        raise
    return call.submit(source.array, output, writeback, returning(adapter, tensor, inplace),
                       op=int(reduction), prescale=prescale, postscale=postscale,
                       **source.fields())


def allgather_async(adapter: TensorAdapter, tensor: Any, name: Optional[str] = None,
                    process_set: Optional[ProcessSet] = None) -> int:
    call = Call(Kind.ALLGATHER, name, process_set)
    try:
        source = Input(adapter, tensor, "allgather")
    except ARGUMENT_ERRORS as error:
        call.mark(error)
        raise
    array = source.array.reshape(1) if source.array.ndim == 0 else source.array
    return call.submit(array, finish=returning(adapter, tensor, False), **source.fields(array))


def broadcast_async(adapter: TensorAdapter, tensor: Any, root_rank: int,
                    name: Optional[str] = None, process_set: Optional[ProcessSet] = None,
                    inplace: bool = False) -> int:
    call = Call(Kind.BROADCAST, name, process_set, "broadcast_" if inplace else None)
    try:
        root = check_root(root_rank, call)
        source = Input(adapter, tensor, "broadcast_" if inplace else "broadcast")
        if inplace:
            output, writeback = inplace_output(source, "broadcast_", adapter.writable(tensor))
        else:
            output, writeback = source.array.copy(), None
    except ARGUMENT_ERRORS as error:
        call.mark(error)
        raise
    return call.submit(source.array, output, writeback, returning(adapter, tensor, inplace),
                       root=root, **source.fields())


def _even_splits(rows: int, size: int, ndim: int) -> tuple[int, ...]:
    if ndim == 0:
        raise UsageError("alltoall needs a tensor with at least one dimension to split; "
                         "got a 0-d tensor")
    if rows % size:
        raise UsageError(f"alltoall without splits needs a first dimension divisible by "
                         f"the process set size {size}; got {rows} rows. Pass splits= "
                         "(rows per destination rank) for uneven exchanges")
    return tuple([rows // size] * size)


def _check_splits(splits: Any, rows: int, size: int, name: str = "",
                  kind: str = "alltoall") -> tuple[int, ...]:
    chosen = tuple(int(s) for s in np.asarray(splits).reshape(-1))
    if len(chosen) != size or min(chosen, default=0) < 0 or sum(chosen) != rows:
        named = f" '{name}'" if name else ""
        raise UsageError(f"{kind}{named} splits {list(chosen)} must be {size} non-negative "
                         f"row counts summing to the first dimension {rows}")
    return chosen


def alltoall_async(adapter: TensorAdapter, tensor: Any, splits: Any = None,
                   name: Optional[str] = None,
                   process_set: Optional[ProcessSet] = None) -> int:
    """Horovod's convention: synchronize returns the received tensor, and with
    ``splits`` given, ``(received, received_splits)``."""
    call = Call(Kind.ALLTOALL, name, process_set)
    try:
        source = Input(adapter, tensor, "alltoall")
        array = source.array
        if splits is None:
            chosen = _even_splits(array.shape[0] if array.ndim else 0, call.set_size, array.ndim)
        else:
            array = array.reshape(1) if array.ndim == 0 else array
            chosen = _check_splits(splits, array.shape[0], call.set_size)
    except ARGUMENT_ERRORS as error:
        call.mark(error)
        raise
    convert = (lambda a: a) if adapter.framework == "numpy" else adapter.from_array

    def finish(result: Any) -> Any:
        received, counts = result
        return convert(received) if splits is None else (convert(received), convert(counts))
    return call.submit(array, finish=finish, splits=chosen, **source.fields(array))


def reducescatter_async(adapter: TensorAdapter, tensor: Any, name: Optional[str] = None,
                        op: Optional[int] = None, process_set: Optional[ProcessSet] = None,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                        splits: Optional[Sequence[int]] = None) -> int:
    """``splits``: the rows each rank of the set receives, alike on every rank (default:
    as even as can be, the first ranks one more)."""
    call = Call(Kind.REDUCESCATTER, name, process_set)
    try:
        reduction = reduce_op(op)
        source = Input(adapter, tensor, "reducescatter")
        if source.array.ndim == 0:
            raise UsageError("reducescatter needs at least one dimension to scatter")
        check_reduction(source, reduction, call.name)
        if reduction is ReduceOp.ADASUM:
            raise UsageError(f"'{call.name}': reducescatter does not support Adasum "
                             "(Horovod refuses it too); use allreduce(op=Adasum)")
        prescale = check_scale(prescale_factor, "prescale_factor")
        postscale = check_scale(postscale_factor, "postscale_factor")
        chosen = (None if splits is None
                  else _check_splits(splits, source.array.shape[0], call.set_size, call.name,
                                     "reducescatter"))
    except ARGUMENT_ERRORS as error:
        call.mark(error)
        raise
    return call.submit(source.array, finish=returning(adapter, tensor, False),
                       op=int(reduction), prescale=prescale, postscale=postscale,
                       splits=chosen, **source.fields())


def _group_base(name: Optional[str], kind: str, process_set: Optional[ProcessSet]) -> str:
    """A grouped op's name; its tensors are ``<base>.<i>``."""
    set_id, _ = set_ranks(process_set)
    return name or runtime.next_name(set_id, f"grouped_{kind}")[0]


def grouped(adapter: TensorAdapter, submit: Callable[..., int], tensors: Sequence[Any],
            name: Optional[str], kind: str, process_set: Optional[ProcessSet],
            **kwargs: Any) -> GroupHandle:
    """One op per tensor, named ``<base>.<i>``, in one round (one fused buffer, one
    ready event). If item i is refused, the items after it are marked as failed on
    this rank, so peers fail them too; tensors on two devices refuse them all."""
    base = _group_base(name, kind, process_set)
    _refuse_two_devices(adapter, tensors, base, kind, process_set)
    return _grouped(submit, tensors, base, kind, process_set, **kwargs)


def _refuse_two_devices(adapter: TensorAdapter, tensors: Sequence[Any], base: str, kind: str,
                        process_set: Optional[ProcessSet]) -> None:
    """A group runs on one device (one stream, one fused buffer, one ready event):
    tensors on two devices are refused on every rank, each item marked as failed."""
    placed = [(index, adapter.device(t)) for index, t in enumerate(tensors)
              if adapter.is_tensor(t)]
    other = next(((i, d) for i, d in placed if d != placed[0][1]), None)
    if other is None:
        return
    error = UsageError(
        f"grouped_{kind.rstrip('_')} '{base}' on rank {runtime.rank()}: tensor 0 is on "
        f"{placed[0][1]} but tensor {other[0]} is on {other[1]}; a group runs on one device. "
        "Move the tensors to one device, or make one group per device")
    for index in range(len(tensors)):
        Call(Kind(kind.rstrip("_")), f"{base}.{index}", process_set).mark(error)
    raise error


def _grouped(submit: Callable[..., int], tensors: Sequence[Any], base: str, kind: str,
             process_set: Optional[ProcessSet], **kwargs: Any) -> GroupHandle:
    submissions = [(f"{base}.{index}",
                    functools.partial(submit, tensor, name=f"{base}.{index}",
                                      process_set=process_set, **kwargs))
                   for index, tensor in enumerate(tensors)]
    return GroupHandle(submit_group(f"grouped_{kind}", Kind(kind.rstrip("_")), process_set,
                                    submissions))


def grouped_allreduce(adapter: TensorAdapter, submit_one: Callable[..., int],
                      tensors: Sequence[Any], name: Optional[str], inplace: bool,
                      process_set: Optional[ProcessSet], **kwargs: Any) -> GroupHandle:
    """``grouped`` for allreduce, with its small CPU tensors bundled into one request
    where they qualify (``bundle.small_items``)."""
    kind = "allreduce_" if inplace else "allreduce"
    tensors = list(tensors)
    base = _group_base(name, kind, process_set)
    _refuse_two_devices(adapter, tensors, base, kind, process_set)
    small = bundle.small_items(adapter, tensors, kwargs.get("op"), kwargs.get("average"))
    if not small:
        return _grouped(submit_one, tensors, base, kind, process_set, **kwargs)
    return bundle.grouped_allreduce(adapter, submit_one, tensors, base, process_set,
                                    inplace, small, **kwargs)


def barrier(process_set: Optional[ProcessSet] = None) -> None:
    """Return once every rank of the process set has called it."""
    synchronize(Call(Kind.BARRIER, None, process_set).submit(None))


def join() -> int:
    """Signal this rank is out of data. Until every rank has joined, this rank
    contributes the op's identity to the others' allreduces (zeros for Sum; Average
    still divides by the full size), and any other collective on a set that holds
    it raises JoinError. Returns the rank that joined last."""
    return synchronize(Call(Kind.JOIN, "join", None).submit(None))


