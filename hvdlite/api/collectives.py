"""The collectives, on any framework's tensors through its adapter.

Every call runs in two steps on the user thread. ``_Call`` resolves the
process set and the name (unnamed ops are numbered per set and kind). Then
the arguments are checked and converted; if that fails, this rank still
submits an *error marker* under the same name before raising, so negotiation
fails the collective on every rank (a MismatchError naming this rank and
argument) instead of leaving the others waiting. Nothing invalid ever
reaches the engine.

In-place ops accept targets of any strides: a non-contiguous target gets a
contiguous staging output, copied back into the target on completion.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable, Optional, Sequence

import numpy as np

from hvdlite.api import runtime
from hvdlite.api.adapter import TensorAdapter
from hvdlite.api.process_set import ProcessSet
from hvdlite.backends.base import even_counts
from hvdlite.core.devices import array_namespace
from hvdlite.core.requests import Descriptor, Kind, ReduceOp, Request, dtype_name
from hvdlite.errors import HvdliteTypeError, UsageError

_OPS_BY_VALUE = {int(op): op for op in ReduceOp}


class GroupHandle:
    """The handle of a grouped op: synchronizing it returns a list of results."""

    def __init__(self, handles: Sequence[int]) -> None:
        self.handles = list(handles)


Handle = Any   # int, or GroupHandle


def poll(handle: Handle) -> bool:
    """True once ``synchronize(handle)`` would return without waiting."""
    engine = runtime.engine("hvdlite.poll()")
    if isinstance(handle, GroupHandle):
        return all(engine.handles.poll(h) for h in handle.handles)
    return engine.handles.poll(handle)


def synchronize(handle: Handle) -> Any:
    """Wait for an async op; return its result (in the caller's framework) or raise
    its error (an HvdliteError)."""
    engine = runtime.RUNTIME.engine
    if engine is None:
        raise runtime.NotInitializedError("hvdlite.synchronize()")
    if isinstance(handle, GroupHandle):
        return [engine.handles.wait(h) for h in handle.handles]
    return engine.handles.wait(handle)


class _Call:
    """One collective call: its set, its name, and submission (or a marker)."""
    __slots__ = ("kind", "set_id", "set_size", "name", "thread")

    def __init__(self, kind: Kind, name: Optional[str], process_set: Optional[ProcessSet],
                 auto_kind: Optional[str] = None) -> None:
        self.kind = kind
        self.set_id, ranks = runtime.set_ranks(process_set)
        me = runtime.rank()
        if self.set_id and me not in ranks:
            raise UsageError(f"rank {me} is not in process set {self.set_id} (ranks "
                             f"{list(ranks)}); only its members may call {kind.value} on it")
        self.set_size = len(ranks)
        self.thread = ""
        if name is None:
            name, self.thread = runtime.next_name(self.set_id, auto_kind or kind.value)
        self.name = name

    def submit(self, array: Any, output: Any = None, writeback: Any = None,
               finish: Optional[Callable[[Any], Any]] = None, **fields: Any) -> int:
        desc = Descriptor(self.name, self.kind, thread=self.thread, **fields)
        request = Request(desc, self.set_id, array, output)
        request.writeback = writeback
        return runtime.engine(f"hvdlite.{self.kind.value}()").submit(request, finish)

    def mark(self, error: BaseException) -> None:
        """Tell every rank, through negotiation, that this rank's call failed."""
        desc = Descriptor(self.name, self.kind, thread=self.thread, error=str(error))
        runtime.engine().submit(Request(desc, self.set_id))


def _guarded(call: _Call, build: Callable[[], int]) -> int:
    """Run ``build`` (checks, conversion, submission); on an argument error, send
    the marker, then raise on this rank."""
    try:
        return build()
    except (UsageError, HvdliteTypeError) as error:
        call.mark(error)
        raise


# -- argument checks (user thread) ---------------------------------------------------------
def reduce_op(op: Optional[int], average: Optional[bool] = None) -> ReduceOp:
    if average is None and op in _OPS_BY_VALUE:
        return _OPS_BY_VALUE[op]   # the common case, without enum construction
    if op is not None and average is not None:
        raise UsageError("pass either op= or the deprecated average=, not both")
    if average is not None:
        return ReduceOp.AVERAGE if average else ReduceOp.SUM
    try:
        return ReduceOp(ReduceOp.AVERAGE if op is None else op)
    except ValueError:
        raise UsageError(f"unknown reduction op {op!r}; use one of hvdlite.Average, Sum, "
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


class _Input:
    """A tensor's array (contiguous, for sending) and the fields that describe it."""
    __slots__ = ("array", "view", "device")

    def __init__(self, adapter: TensorAdapter, tensor: Any, what: str) -> None:
        view = adapter.to_array(adapter.require(tensor, what))
        if not _dtype_class(np.dtype(view.dtype)):
            raise HvdliteTypeError(
                f"{what}: unsupported dtype {view.dtype}; hvdlite moves numeric arrays "
                "(integers, float16/bfloat16/32/64, complex) and bool")
        self.view = view                      # the caller's memory, strides and all
        self.device = adapter.device(tensor)
        self.array = view if view.flags.c_contiguous else _contiguous(view, self.device)

    def fields(self, array: Any = None) -> dict[str, Any]:
        array = self.array if array is None else array
        return {"dtype": dtype_name(array.dtype), "shape": array.shape, "device": self.device}


def _contiguous(view: Any, device: str) -> Any:
    return array_namespace(device).ascontiguousarray(view)


def _inplace_output(source: _Input, what: str) -> tuple[Any, Any]:
    """(output the engine writes, target to copy it back into, or None)."""
    view = source.view
    if not view.flags.writeable:
        raise HvdliteTypeError(f"{what} writes its result into the tensor, which is read-only")
    if any(stride == 0 and extent > 1 for stride, extent in zip(view.strides, view.shape)):
        raise UsageError(f"{what} cannot write into a tensor whose elements share memory "
                         f"(shape {view.shape}, strides {view.strides}, e.g. an expand()ed "
                         "view); pass a tensor with its own memory, or use the out-of-place op")
    if view.flags.c_contiguous:
        return view, None
    return source.array, view      # the staging copy already holds the input


def _check_reduction(source: _Input, op: ReduceOp, name: str) -> None:
    kind = _dtype_class(np.dtype(source.array.dtype))
    if kind == "bool":
        raise HvdliteTypeError(f"'{name}': cannot reduce bool arrays; cast to an integer type")
    if kind == "complex" and op in (ReduceOp.MIN, ReduceOp.MAX):
        raise HvdliteTypeError(f"'{name}': {op.name} is undefined for complex dtype "
                               f"{source.array.dtype}")


def _check_scale(value: float, label: str) -> float:
    if value == 1.0:
        return 1.0
    value = float(value)
    if not math.isfinite(value):
        raise UsageError(f"{label} must be finite, got {value}")
    return value


def _check_root(root_rank: int, call: _Call) -> int:
    root = int(root_rank)
    if not 0 <= root < call.set_size:
        raise UsageError(f"root_rank={root_rank} is outside the process set of size "
                         f"{call.set_size} (valid: 0..{call.set_size - 1})")
    return root


# -- the collectives on one adapter's tensors ------------------------------------------------
Finish = Optional[Callable[[Any], Any]]


def _returning(adapter: TensorAdapter, tensor: Any, inplace: bool) -> Finish:
    """What synchronize returns: the caller's tensor for in-place ops, else the
    result array as the adapter's tensor."""
    if inplace:
        return lambda _: tensor
    return None if adapter.framework == "numpy" else adapter.from_array


def allreduce_async(adapter: TensorAdapter, tensor: Any, average: Optional[bool] = None,
                    name: Optional[str] = None, op: Optional[int] = None,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: Optional[ProcessSet] = None, inplace: bool = False) -> int:
    call = _Call(Kind.ALLREDUCE, name, process_set, "allreduce_" if inplace else None)

    def build() -> int:
        reduction = reduce_op(op, average)
        source = _Input(adapter, tensor, "allreduce_" if inplace else "allreduce")
        _check_reduction(source, reduction, call.name)
        if inplace:
            output, writeback = _inplace_output(source, "allreduce_")
        else:
            output, writeback = array_namespace(source.device).empty_like(source.array), None
        return call.submit(source.array, output, writeback, _returning(adapter, tensor, inplace),
                           op=int(reduction), **source.fields(),
                           prescale=_check_scale(prescale_factor, "prescale_factor"),
                           postscale=_check_scale(postscale_factor, "postscale_factor"))
    return _guarded(call, build)


def allgather_async(adapter: TensorAdapter, tensor: Any, name: Optional[str] = None,
                    process_set: Optional[ProcessSet] = None) -> int:
    call = _Call(Kind.ALLGATHER, name, process_set)

    def build() -> int:
        source = _Input(adapter, tensor, "allgather")
        array = source.array.reshape(1) if source.array.ndim == 0 else source.array
        return call.submit(array, finish=_returning(adapter, tensor, False),
                           **source.fields(array))
    return _guarded(call, build)


def broadcast_async(adapter: TensorAdapter, tensor: Any, root_rank: int,
                    name: Optional[str] = None, process_set: Optional[ProcessSet] = None,
                    inplace: bool = False) -> int:
    call = _Call(Kind.BROADCAST, name, process_set, "broadcast_" if inplace else None)

    def build() -> int:
        root = _check_root(root_rank, call)
        source = _Input(adapter, tensor, "broadcast_" if inplace else "broadcast")
        if inplace:
            output, writeback = _inplace_output(source, "broadcast_")
        else:
            output, writeback = source.array.copy(), None
        return call.submit(source.array, output, writeback, _returning(adapter, tensor, inplace),
                           root=root, **source.fields())
    return _guarded(call, build)


def _even_splits(rows: int, size: int, ndim: int) -> tuple[int, ...]:
    if ndim == 0:
        raise UsageError("alltoall needs a tensor with at least one dimension to split; "
                         "got a 0-d tensor")
    if rows % size:
        raise UsageError(f"alltoall without splits needs a first dimension divisible by "
                         f"the process set size {size}; got {rows} rows. Pass splits= "
                         "(rows per destination rank) for uneven exchanges")
    return tuple([rows // size] * size)


def _check_splits(splits: Any, rows: int, size: int) -> tuple[int, ...]:
    chosen = tuple(int(s) for s in np.asarray(splits).reshape(-1))
    if len(chosen) != size or min(chosen, default=0) < 0 or sum(chosen) != rows:
        raise UsageError(f"alltoall splits {list(chosen)} must be {size} non-negative "
                         f"row counts summing to the first dimension {rows}")
    return chosen


def alltoall_async(adapter: TensorAdapter, tensor: Any, splits: Any = None,
                   name: Optional[str] = None,
                   process_set: Optional[ProcessSet] = None) -> int:
    """Horovod's convention: synchronize returns the received tensor, and with
    ``splits`` given, ``(received, received_splits)``."""
    call = _Call(Kind.ALLTOALL, name, process_set)

    def build() -> int:
        source = _Input(adapter, tensor, "alltoall")
        array = source.array
        if splits is None:
            chosen = _even_splits(array.shape[0] if array.ndim else 0, call.set_size, array.ndim)
        else:
            array = array.reshape(1) if array.ndim == 0 else array
            chosen = _check_splits(splits, array.shape[0], call.set_size)
        convert = (lambda a: a) if adapter.framework == "numpy" else adapter.from_array

        def finish(result: Any) -> Any:
            received, counts = result
            return convert(received) if splits is None else (convert(received), convert(counts))
        return call.submit(array, finish=finish, splits=chosen, **source.fields(array))
    return _guarded(call, build)


def reducescatter_async(adapter: TensorAdapter, tensor: Any, name: Optional[str] = None,
                        op: Optional[int] = None, process_set: Optional[ProcessSet] = None,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> int:
    call = _Call(Kind.REDUCESCATTER, name, process_set)

    def build() -> int:
        reduction = reduce_op(op)
        source = _Input(adapter, tensor, "reducescatter")
        if source.array.ndim == 0:
            raise UsageError("reducescatter needs at least one dimension to scatter")
        _check_reduction(source, reduction, call.name)
        return call.submit(source.array, finish=_returning(adapter, tensor, False),
                           op=int(reduction), **source.fields(),
                           prescale=_check_scale(prescale_factor, "prescale_factor"),
                           postscale=_check_scale(postscale_factor, "postscale_factor"))
    return _guarded(call, build)


def grouped(submit: Callable[..., int], tensors: Sequence[Any], name: Optional[str],
            kind: str, process_set: Optional[ProcessSet], **kwargs: Any) -> GroupHandle:
    """One op per tensor, named ``<base>.<i>``. If item i is refused, the items
    from i on are marked as failed on this rank, so peers fail them too."""
    tensors = list(tensors)
    set_id, _ = runtime.set_ranks(process_set)
    base = name or runtime.next_name(set_id, f"grouped_{kind}")[0]
    handles: list[int] = []
    for index, tensor in enumerate(tensors):
        try:
            handles.append(submit(tensor, name=f"{base}.{index}", process_set=process_set,
                                  **kwargs))
        except (UsageError, HvdliteTypeError) as error:
            for later in range(index + 1, len(tensors)):
                _Call(Kind(kind.rstrip("_")), f"{base}.{later}", process_set).mark(error)
            raise
    return GroupHandle(handles)


def barrier(process_set: Optional[ProcessSet] = None) -> None:
    synchronize(_Call(Kind.BARRIER, None, process_set).submit(None))


def join() -> int:
    """Signal this rank is out of data. Until every rank has joined, this rank
    contributes zeros to the others' allreduces (Average still divides by the
    full size). Returns the rank that joined last."""
    return synchronize(_Call(Kind.JOIN, "join", None).submit(None))


def add_process_set(process_set: Any) -> ProcessSet:
    """Register a process set; every rank calls this with the same ranks, in order."""
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    world = runtime.size()
    if ps.ranks[-1] >= world or ps.ranks[0] < 0:
        raise UsageError(f"{ps!r} names ranks outside 0..{world - 1}")
    if runtime.engine().registry.id_of(ps.ranks) is not None:
        raise UsageError(f"a process set with ranks {ps.ranks} is already registered")
    call = _Call(Kind.ADD_PROCESS_SET, None, None)
    ps.process_set_id = synchronize(call.submit(None, ranks=tuple(ps.ranks)))
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a set on every rank; False if it was not registered."""
    set_id = process_set.process_set_id
    if set_id in (None, 0) or runtime.engine().registry.ranks_of(set_id) is None:
        return False
    removed = synchronize(_Call(Kind.REMOVE_PROCESS_SET, None, None).submit(None, set_id=set_id))
    process_set.process_set_id = None
    return bool(removed)


def reconfigure(**settings: Any) -> None:
    """Change settings (e.g. ``allreduce="ring"``) on every rank at the same point in
    the order of collectives: a negotiated request, so the engine never sees a
    setting change under a collective in flight. Collective: every rank calls it
    with the same settings (a MismatchError otherwise)."""
    runtime.config().replace(**settings)      # validates the names before negotiating
    call = _Call(Kind.RECONFIGURE, None, None)
    synchronize(call.submit(None, settings=tuple(sorted(settings.items()))))
