"""Collectives on NumPy arrays, in Horovod's shape: ``op`` returns the result,
``op_async`` returns a handle for ``synchronize``/``poll``, a trailing ``_``
writes the result into the argument. Framework bindings hand in arrays that
share memory with their tensors."""
from __future__ import annotations

import functools
import math
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np

from hvdlite.backends import even_counts
from hvdlite.core import state
from hvdlite.core.process_sets import ProcessSet
from hvdlite.core.requests import (Descriptor, Kind, ReduceOp, Request, dtype_name)

Average, Sum, Min, Max, Product = (ReduceOp.AVERAGE, ReduceOp.SUM, ReduceOp.MIN,
                                   ReduceOp.MAX, ReduceOp.PRODUCT)


class GroupHandle:
    """The handle of a grouped op: synchronizing it returns a list of results."""

    def __init__(self, handles: Sequence[int]) -> None:
        self.handles = list(handles)


Handle = Union[int, GroupHandle]


def poll(handle: Handle) -> bool:
    """True once ``synchronize(handle)`` would return without waiting."""
    engine = state.engine("hvdlite.poll()")
    if isinstance(handle, GroupHandle):
        return all(engine.handles.poll(h) for h in handle.handles)
    return engine.handles.poll(handle)


def synchronize(handle: Handle) -> Any:
    """Wait for an async op; return its result or raise its error (HvdliteError)."""
    if state.STATE.engine is None:
        raise state.NotInitializedError("hvdlite.synchronize()")
    handles = state.STATE.engine.handles
    if isinstance(handle, GroupHandle):
        return [handles.wait(h) for h in handle.handles]
    return handles.wait(handle)


# -- validation -------------------------------------------------------------------------
_OPS_BY_VALUE = {int(op): op for op in ReduceOp}


def _reduce_op(op: Optional[int], average: Optional[bool] = None) -> ReduceOp:
    if average is None and op in _OPS_BY_VALUE:
        return _OPS_BY_VALUE[op]   # the common case, without enum construction
    if op is not None and average is not None:
        raise ValueError("pass either op= or the deprecated average=, not both")
    if average is not None:
        return ReduceOp.AVERAGE if average else ReduceOp.SUM
    try:
        return ReduceOp(ReduceOp.AVERAGE if op is None else op)
    except ValueError:
        raise ValueError(f"unknown reduction op {op!r}; use one of hvdlite.Average, Sum, "
                         "Min, Max, Product") from None


@functools.lru_cache(maxsize=None)
def _dtype_class(dtype: np.dtype) -> str:
    """'int', 'float', 'complex', 'bool' or '' (unsupported); cached per dtype
    because numpy's issubdtype is slow on a path taken once per tensor."""
    if dtype == np.bool_:
        return "bool"
    if dtype.name == "bfloat16" or np.issubdtype(dtype, np.floating):
        return "float"
    if np.issubdtype(dtype, np.integer):
        return "int"
    return "complex" if np.issubdtype(dtype, np.complexfloating) else ""


def _as_array(tensor: Any, what: str) -> np.ndarray:
    array = np.asarray(tensor)
    if not _dtype_class(array.dtype):
        raise TypeError(f"{what}: unsupported dtype {array.dtype}; hvdlite moves numeric "
                        "arrays (integers, float16/bfloat16/32/64, complex) and bool")
    return array if array.flags.c_contiguous else np.ascontiguousarray(array)


def _check_reduction(array: np.ndarray, op: ReduceOp, name: str) -> None:
    kind = _dtype_class(array.dtype)
    if kind == "bool":
        raise TypeError(f"'{name}': cannot reduce bool arrays; cast to an integer type")
    if kind == "complex" and op in (ReduceOp.MIN, ReduceOp.MAX):
        raise TypeError(f"'{name}': {op.name} is undefined for complex dtype {array.dtype}")


def _check_scale(value: float, label: str) -> float:
    if value == 1.0:
        return 1.0
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{label} must be finite, got {value}")
    return value


def _submit(kind: Kind, array: Optional[np.ndarray], name: Optional[str],
            process_set: Optional[ProcessSet], output: Optional[np.ndarray] = None,
            **fields: Any) -> int:
    engine = state.engine(f"hvdlite.{kind.value}()")
    if process_set is None or process_set is state.global_process_set:
        set_id = 0          # every rank is a member: skip the membership check
    else:
        set_id, ps = state.find_process_set(process_set)
        if state.rank() not in ps.ranks:
            raise ValueError(f"rank {state.rank()} is not in {ps!r}; only its members may "
                             f"call {kind.value} on it")
    if array is not None:
        fields["dtype"] = dtype_name(array.dtype)
        fields["shape"] = array.shape
    desc = Descriptor(name or state.next_name(kind.value), kind, **fields)
    return engine.submit(Request(desc, set_id, array, output))


# -- allreduce ----------------------------------------------------------------------------
def _allreduce_submit(tensor: Any, average: Optional[bool], name: Optional[str], op: Optional[int],
                      prescale_factor: float, postscale_factor: float,
                      process_set: Optional[ProcessSet], inplace: bool) -> int:
    reduce_op = _reduce_op(op, average)
    array = _as_array(tensor, "allreduce")
    _check_reduction(array, reduce_op, name or "allreduce")
    output = _inplace_target(tensor, "allreduce_") if inplace else np.empty_like(array)
    return _submit(Kind.ALLREDUCE, array, name, process_set, output, op=int(reduce_op),
                   prescale=_check_scale(prescale_factor, "prescale_factor"),
                   postscale=_check_scale(postscale_factor, "postscale_factor"))


def _inplace_target(tensor: Any, what: str) -> np.ndarray:
    if not isinstance(tensor, np.ndarray) or not tensor.flags.writeable:
        raise TypeError(f"{what} needs a writeable numpy array to write into")
    return tensor


def allreduce_async(tensor: Any, average: Optional[bool] = None, name: Optional[str] = None,
                    op: Optional[int] = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0,
                    process_set: Optional[ProcessSet] = None) -> int:
    return _allreduce_submit(tensor, average, name, op, prescale_factor, postscale_factor,
                             process_set, inplace=False)


def allreduce(tensor: Any, average: Optional[bool] = None, name: Optional[str] = None,
              op: Optional[int] = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, process_set: Optional[ProcessSet] = None) -> np.ndarray:
    """Reduce ``tensor`` across the process set (default op: Average)."""
    return synchronize(allreduce_async(tensor, average, name, op, prescale_factor,
                                       postscale_factor, process_set))


def allreduce_async_(tensor: np.ndarray, average: Optional[bool] = None,
                     name: Optional[str] = None, op: Optional[int] = None,
                     prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: Optional[ProcessSet] = None) -> int:
    return _allreduce_submit(tensor, average, name, op, prescale_factor, postscale_factor,
                             process_set, inplace=True)


def allreduce_(tensor: np.ndarray, average: Optional[bool] = None, name: Optional[str] = None,
               op: Optional[int] = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0, process_set: Optional[ProcessSet] = None) -> np.ndarray:
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor, process_set))


def _grouped(submit: Callable[..., int], tensors: Sequence[Any], name: Optional[str],
             kind: str, **kwargs: Any) -> GroupHandle:
    base = name or state.next_name(f"grouped_{kind}")
    return GroupHandle([submit(t, name=f"{base}.{i}", **kwargs) for i, t in enumerate(tensors)])


def grouped_allreduce_async(tensors: Sequence[Any], average: Optional[bool] = None,
                            name: Optional[str] = None, op: Optional[int] = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: Optional[ProcessSet] = None) -> GroupHandle:
    return _grouped(allreduce_async, tensors, name, "allreduce", average=average, op=op,
                    prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                    process_set=process_set)


def grouped_allreduce(tensors: Sequence[Any], average: Optional[bool] = None,
                      name: Optional[str] = None, op: Optional[int] = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: Optional[ProcessSet] = None) -> list[np.ndarray]:
    return synchronize(grouped_allreduce_async(tensors, average, name, op, prescale_factor,
                                               postscale_factor, process_set))


def grouped_allreduce_async_(tensors: Sequence[np.ndarray], average: Optional[bool] = None,
                             name: Optional[str] = None, op: Optional[int] = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: Optional[ProcessSet] = None) -> GroupHandle:
    return _grouped(allreduce_async_, tensors, name, "allreduce_", average=average, op=op,
                    prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                    process_set=process_set)


def grouped_allreduce_(tensors: Sequence[np.ndarray], average: Optional[bool] = None,
                       name: Optional[str] = None, op: Optional[int] = None,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: Optional[ProcessSet] = None) -> list[np.ndarray]:
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set))


# -- data movement ---------------------------------------------------------------------------
def allgather_async(tensor: Any, name: Optional[str] = None,
                    process_set: Optional[ProcessSet] = None) -> int:
    array = _as_array(tensor, "allgather")
    array = array.reshape(1) if array.ndim == 0 else array
    return _submit(Kind.ALLGATHER, array, name, process_set)


def allgather(tensor: Any, name: Optional[str] = None,
              process_set: Optional[ProcessSet] = None) -> np.ndarray:
    """Concatenate every rank's tensor along the first dimension (which may differ)."""
    return synchronize(allgather_async(tensor, name, process_set))


def grouped_allgather(tensors: Sequence[Any], name: Optional[str] = None,
                      process_set: Optional[ProcessSet] = None) -> list[np.ndarray]:
    return synchronize(_grouped(allgather_async, tensors, name, "allgather",
                                process_set=process_set))


def _broadcast_submit(tensor: Any, root_rank: int, name: Optional[str],
                      process_set: Optional[ProcessSet], inplace: bool) -> int:
    array = _as_array(tensor, "broadcast")
    _, ps = state.find_process_set(process_set)
    if not 0 <= int(root_rank) < ps.size():
        raise ValueError(f"root_rank={root_rank} is outside the process set of size {ps.size()}")
    output = _inplace_target(tensor, "broadcast_") if inplace else array.copy()
    return _submit(Kind.BROADCAST, array, name, process_set, output, root=int(root_rank))


def broadcast_async(tensor: Any, root_rank: int, name: Optional[str] = None,
                    process_set: Optional[ProcessSet] = None) -> int:
    return _broadcast_submit(tensor, root_rank, name, process_set, inplace=False)


def broadcast(tensor: Any, root_rank: int, name: Optional[str] = None,
              process_set: Optional[ProcessSet] = None) -> np.ndarray:
    """Every rank receives ``root_rank``'s tensor (root_rank counts within the set)."""
    return synchronize(broadcast_async(tensor, root_rank, name, process_set))


def broadcast_async_(tensor: np.ndarray, root_rank: int, name: Optional[str] = None,
                     process_set: Optional[ProcessSet] = None) -> int:
    return _broadcast_submit(tensor, root_rank, name, process_set, inplace=True)


def broadcast_(tensor: np.ndarray, root_rank: int, name: Optional[str] = None,
               process_set: Optional[ProcessSet] = None) -> np.ndarray:
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def alltoall_async(tensor: Any, splits: Optional[Sequence[int]] = None,
                   name: Optional[str] = None, process_set: Optional[ProcessSet] = None) -> int:
    array = _as_array(tensor, "alltoall")
    array = array.reshape(1) if array.ndim == 0 else array
    _, ps = state.find_process_set(process_set)
    chosen = even_counts(array.shape[0], ps.size()) if splits is None else [
        int(s) for s in np.asarray(splits).reshape(-1)]
    if len(chosen) != ps.size() or min(chosen) < 0 or sum(chosen) != array.shape[0]:
        raise ValueError(f"alltoall splits {chosen} must be {ps.size()} non-negative "
                         f"row counts summing to the first dimension {array.shape[0]}")
    return _submit(Kind.ALLTOALL, array, name, process_set, splits=tuple(chosen))


def alltoall(tensor: Any, splits: Optional[Sequence[int]] = None, name: Optional[str] = None,
             process_set: Optional[ProcessSet] = None) -> tuple[np.ndarray, np.ndarray]:
    """Send ``splits[i]`` rows to rank i; returns (received rows, rows received per rank)."""
    return synchronize(alltoall_async(tensor, splits, name, process_set))


def reducescatter_async(tensor: Any, op: Optional[int] = None, name: Optional[str] = None,
                        process_set: Optional[ProcessSet] = None, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> int:
    reduce_op = _reduce_op(op)
    array = _as_array(tensor, "reducescatter")
    if array.ndim == 0:
        raise ValueError("reducescatter needs at least one dimension to scatter")
    _check_reduction(array, reduce_op, name or "reducescatter")
    return _submit(Kind.REDUCESCATTER, array, name, process_set, op=int(reduce_op),
                   prescale=_check_scale(prescale_factor, "prescale_factor"),
                   postscale=_check_scale(postscale_factor, "postscale_factor"))


def reducescatter(tensor: Any, op: Optional[int] = None, name: Optional[str] = None,
                  process_set: Optional[ProcessSet] = None, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> np.ndarray:
    """Reduce across ranks, then rank i keeps the i-th block of rows; with n rows
    and P ranks the first n % P ranks get one row more."""
    return synchronize(reducescatter_async(tensor, op, name, process_set, prescale_factor,
                                           postscale_factor))


def grouped_reducescatter(tensors: Sequence[Any], op: Optional[int] = None,
                          name: Optional[str] = None,
                          process_set: Optional[ProcessSet] = None) -> list[np.ndarray]:
    return synchronize(_grouped(reducescatter_async, tensors, name, "reducescatter", op=op,
                                process_set=process_set))


# -- synchronization and process sets -------------------------------------------------------
def barrier(process_set: Optional[ProcessSet] = None) -> None:
    synchronize(_submit(Kind.BARRIER, None, None, process_set))


def join() -> int:
    """Signal this rank is out of data. Until every rank has joined, this rank
    contributes zeros to the others' allreduces (Average still divides by the
    full size). Returns the rank that joined last."""
    return synchronize(_submit(Kind.JOIN, None, "join", None))


def add_process_set(process_set: Union[ProcessSet, Sequence[int]]) -> ProcessSet:
    """Register a process set; every rank calls this with the same ranks, in order."""
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    size = state.size()
    if ps.ranks[-1] >= size or ps.ranks[0] < 0:
        raise ValueError(f"{ps!r} names ranks outside 0..{size - 1}")
    if any(other.ranks == ps.ranks for other in state.STATE.process_sets.values()):
        raise ValueError(f"a process set with ranks {ps.ranks} is already registered")
    set_id = synchronize(_submit(Kind.ADD_PROCESS_SET, None, None, None, ranks=tuple(ps.ranks)))
    ps.process_set_id = set_id
    state.STATE.process_sets[set_id] = ps
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a set on every rank; False if it was not registered."""
    set_id = process_set.process_set_id
    if set_id in (None, 0) or set_id not in state.STATE.process_sets:
        return False
    synchronize(_submit(Kind.REMOVE_PROCESS_SET, None, None, None, root=set_id))
    del state.STATE.process_sets[set_id]
    process_set.process_set_id = None
    return True
