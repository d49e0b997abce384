"""Submitting a collective, for any framework's tensors through its adapter.

Every call runs in two steps on the user thread. ``Call`` resolves the
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

import contextlib
import functools
import math
import threading
import time
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np

from hvdlite.api import runtime
from hvdlite.api.adapter import TensorAdapter
from hvdlite.api.process_set import ProcessSet, global_process_set
from hvdlite.engine.devices import Fenced, array_namespace
from hvdlite.errors import HvdliteTypeError, NotSupportedError, UsageError
from hvdlite.negotiation.requests import Descriptor, Kind, ReduceOp, Request, dtype_name
from hvdlite.reduce_op import OPS_BY_VALUE



class GroupHandle:
    """The handle of a grouped op: synchronizing it returns a list of results
    (``collect`` makes that list from the handles' results, where one handle
    stands for several tensors: a bundle, see ``bundle``)."""

    def __init__(self, handles: Sequence[int],
                 collect: Optional[Callable[[list[Any]], list[Any]]] = None) -> None:
        self.handles = list(handles)
        self.collect = collect


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
    recorder = runtime.RUNTIME.recorder
    if recorder is None:
        if handle.__class__ is int:       # the common case, a call shorter
            return engine.handles.wait(handle)
        return _wait(engine, handle)
    started = time.perf_counter()       # HVDLITE_REPORT: time blocked in collectives
    try:
        return _wait(engine, handle)
    finally:
        recorder.collective_wait(time.perf_counter() - started)


def _wait(engine: Any, handle: Handle) -> Any:
    if isinstance(handle, GroupHandle):
        results = [engine.handles.wait(h) for h in handle.handles]
        return results if handle.collect is None else handle.collect(results)
    return engine.handles.wait(handle)


def set_ranks(process_set: Optional[ProcessSet]) -> tuple[int, tuple[int, ...]]:
    """(id, global ranks) of a registered set; None means the global set."""
    current = runtime.engine("a collective")
    if process_set is None or process_set is global_process_set:
        return 0, tuple(range(runtime.size()))
    set_id = process_set.process_set_id
    if set_id is None:
        raise UsageError(f"{process_set!r} is not registered; call "
                         "hvdlite.add_process_set() on every rank first")
    ranks = current.registry.ranks_of(set_id)
    if ranks is None:
        raise UsageError(f"{process_set!r} has been removed; add it again with "
                         "hvdlite.add_process_set() on every rank")
    return set_id, ranks


class Call:
    """One collective call: its set, its name, and submission (or a marker)."""
    __slots__ = ("kind", "set_id", "set_size", "ranks", "name", "thread", "engine")

    def __init__(self, kind: Kind, name: Optional[str], process_set: Optional[ProcessSet],
                 auto_kind: Optional[str] = None) -> None:
        self.kind = kind
        engine = runtime.RUNTIME.engine
        self.engine = engine if engine is not None and engine.dead is None else (
            runtime.engine("a collective"))          # raises the reason
        if process_set is None or process_set is global_process_set:
            # The common case, taken once per tensor: no rank list, no membership test.
            self.set_id, self.set_size = 0, runtime.RUNTIME.topology.size
            self.ranks: Optional[tuple[int, ...]] = None     # every rank, in order
        else:
            self.set_id, ranks = set_ranks(process_set)
            me = runtime.rank()
            if me not in ranks:
                raise UsageError(f"rank {me} is not in process set {self.set_id} (ranks "
                                 f"{list(ranks)}); only its members may call {kind.value} "
                                 "on it")
            self.set_size, self.ranks = len(ranks), ranks
        self.thread = ""
        if name is None:
            name, self.thread = runtime.next_name(self.set_id, auto_kind or kind.value)
        self.name = name

    def submit(self, array: Any, output: Any = None, writeback: Any = None,
               finish: Optional[Callable[[Any], Any]] = None, ready: Any = None,
               adapter: Any = None, **fields: Any) -> int:
        """Queue the request. ``ready`` (GPU tensors) orders the engine after the
        framework's stream; results then come back fenced, and ``adapter`` makes
        the caller's stream wait on the fence before ``finish`` hands them over."""
        desc = Descriptor(self.name, self.kind, thread=self.thread, **fields)
        request = Request(desc, self.set_id, array, output)
        request.writeback = writeback
        if ready is not None:
            request.ready = ready
        if adapter is not None and desc.device != "cpu":
            finish = _unfenced(adapter, finish)
        return self.engine.submit(request, finish)

    def mark(self, error: BaseException) -> None:
        """Tell every rank, through negotiation, that this rank's call failed."""
        desc = Descriptor(self.name, self.kind, thread=self.thread, error=str(error))
        self.engine.submit(Request(desc, self.set_id))


def _unfenced(adapter: Any, finish: Optional[Callable[[Any], Any]]) -> Callable[[Any], Any]:
    def wait_then_finish(result: Any) -> Any:
        if isinstance(result, Fenced):
            adapter.wait_fence(result.fence)
            result = result.value
        return result if finish is None else finish(result)
    return wait_then_finish


# What a call's checks raise for bad arguments: these, and only these, are also
# sent to the peers as an error marker (a DuplicateNameError from submission is
# about this rank's own bookkeeping, not an argument, and is raised as it is).
ARGUMENT_ERRORS = (UsageError, HvdliteTypeError)


# -- argument checks (user thread) ---------------------------------------------------------
def reduce_op(op: Optional[int], average: Optional[bool] = None) -> ReduceOp:
    if average is None and op in OPS_BY_VALUE:
        return OPS_BY_VALUE[op]   # the common case, without enum construction
    if op is not None and average is not None:
        raise UsageError("pass either op= or the deprecated average=, not both")
    if average is not None:
        return ReduceOp.AVERAGE if average else ReduceOp.SUM
    try:
        return ReduceOp(ReduceOp.AVERAGE if op is None else op)
    except ValueError:
        raise UsageError(f"unknown reduction op {op!r}; use one of hvdlite.Average, Sum, "
                         "Adasum, Min, Max, Product") from None


@functools.lru_cache(maxsize=None)
def dtype_class(dtype: np.dtype) -> str:
    """'int', 'float', 'complex', 'bool' or '' (unsupported); cached per dtype
    because numpy's issubdtype is slow on a path taken once per tensor."""
    if dtype == np.bool_:
        return "bool"
    if dtype.name == "bfloat16" or np.issubdtype(dtype, np.floating):
        return "float"
    if np.issubdtype(dtype, np.integer):
        return "int"
    return "complex" if np.issubdtype(dtype, np.complexfloating) else ""


class Input:
    """A tensor's array (contiguous, for sending) and the fields that describe it."""
    __slots__ = ("array", "view", "device", "adapter", "ready", "dtype_class")

    def __init__(self, adapter: TensorAdapter, tensor: Any, what: str) -> None:
        view = adapter.to_array(adapter.require(tensor, what))
        self.dtype_class = dtype_class(view.dtype)
        if not self.dtype_class:
            raise HvdliteTypeError(
                f"{what}: unsupported dtype {view.dtype}; hvdlite moves numeric arrays "
                "(integers, float16/bfloat16/32/64, complex) and bool")
        self.view = view                      # the caller's memory, strides and all
        device = self.device = adapter.device(tensor)
        self.adapter = adapter
        if device == "cpu":
            self.ready = None
            self.array = view if view.flags.c_contiguous else np.ascontiguousarray(view)
        elif view.flags.c_contiguous:
            self.array = view
            self.ready = _ready_event(adapter, tensor, device)
        else:
            self.array = _contiguous(adapter, tensor, view, device)
            self.ready = adapter.ready_event(tensor)      # after the copy: it covers it

    def fields(self, array: Any = None) -> dict[str, Any]:
        """The descriptor fields, plus what submit needs for a GPU tensor's streams."""
        array = self.array if array is None else array
        if self.device == "cpu":
            return {"dtype": dtype_name(array.dtype), "shape": array.shape}
        return {"dtype": dtype_name(array.dtype), "shape": tuple(array.shape),
                "device": self.device, "ready": self.ready, "adapter": self.adapter}


def _contiguous(adapter: TensorAdapter, tensor: Any, view: Any, device: str) -> Any:
    """A contiguous copy of a strided GPU tensor, made on the framework's stream
    where the adapter can (so the ready event recorded next covers it)."""
    copy = adapter.contiguous(tensor)
    if copy is None:
        return array_namespace(device).ascontiguousarray(view)
    return adapter.to_array(copy)


_TOGETHER = threading.local()      # .events: {device: ready event} inside together()


@contextlib.contextmanager
def together(what: str) -> Iterator[None]:
    """Submissions that reach the engine in one round (``engine.batch``). Their GPU
    tensors all exist before it begins (a grouped op's list, a bucket of gradients),
    so one ready event per device, recorded at the first, covers every one."""
    with runtime.engine(what).batch():
        if getattr(_TOGETHER, "events", None) is not None:
            yield
            return
        _TOGETHER.events = {}
        try:
            yield
        finally:
            _TOGETHER.events = None


def submit_group(what: str, kind: Kind, process_set: Optional[ProcessSet],
                 submissions: Sequence[tuple[str, Callable[[], int]]]) -> list[int]:
    """Run ``(name, submit)`` pairs in order, together (one round), and return their
    handles. If one is refused, the names after it are marked failed on this rank,
    so the peers fail them too instead of waiting for them."""
    handles: list[int] = []
    with together(what):
        for index, (_, submit) in enumerate(submissions):
            try:
                handles.append(submit())
            except ARGUMENT_ERRORS as error:
                for later, _ in submissions[index + 1:]:
                    Call(kind, later, process_set).mark(error)
                raise
    return handles


def returning(adapter: TensorAdapter, tensor: Any, inplace: bool) -> Optional[Callable[[Any], Any]]:
    """What synchronize returns: the caller's tensor for in-place ops, else the
    result array as the adapter's tensor."""
    if adapter.framework == "numpy":
        return None        # the result array is the caller's array (in place) or the result
    if inplace:
        return lambda result: adapter.inplace_done(tensor, result)
    return adapter.from_array


def _ready_event(adapter: TensorAdapter, tensor: Any, device: str) -> Any:
    shared = getattr(_TOGETHER, "events", None)
    if shared is None:
        return adapter.ready_event(tensor)
    if device not in shared:
        shared[device] = adapter.ready_event(tensor)
    return shared[device]


def inplace_output(source: Input, what: str, writable: bool = True) -> tuple[Any, Any]:
    """(output the engine writes, target to copy it back into, or None)."""
    view = source.view
    if not (writable and getattr(view.flags, "writeable", True)):   # CuPy has no such flag
        raise HvdliteTypeError(f"{what} writes its result into the tensor, which is read-only")
    if view.flags.c_contiguous:        # the common case; shared memory is never contiguous
        return view, None
    if any(stride == 0 and extent > 1 for stride, extent in zip(view.strides, view.shape)):
        raise UsageError(f"{what} cannot write into a tensor whose elements share memory "
                         f"(shape {view.shape}, strides {view.strides}, e.g. an expand()ed "
                         "view); pass a tensor with its own memory, or use the out-of-place op")
    return source.array, view      # the staging copy already holds the input


def check_reduction(source: Input, op: ReduceOp, name: str) -> None:
    kind = source.dtype_class
    if kind == "bool":
        raise HvdliteTypeError(f"'{name}': cannot reduce bool arrays; cast to an integer type")
    if kind == "complex" and op in (ReduceOp.MIN, ReduceOp.MAX):
        raise HvdliteTypeError(f"'{name}': {op.name} is undefined for complex dtype "
                               f"{source.array.dtype}")


def check_on_mpi(what: str, name: str) -> None:
    """Adasum runs on MPI's communicators only, yet: under torchrun every rank refuses
    the call (NotSupportedError, Horovod's NotImplementedError) instead of the engine
    failing when no backend of the torch transport takes it."""
    transport = runtime.transport_name()
    if transport not in (None, "mpi"):
        raise NotSupportedError(f"'{name}': {what} needs MPI (mpiexec or hvdliterun); the "
                                f"{transport} transport torchrun starts has no {what} yet")


def check_adasum(source: Input, set_size: int, name: str) -> None:
    """Adasum's limits, refused on the calling thread so every rank raises the same
    UsageError (Horovod raises NotImplementedError for a non-power-of-two size;
    UsageError is also a ValueError/RuntimeError, as hvdlite's misuse errors are)."""
    check_on_mpi("Adasum", name)
    if source.dtype_class != "float":
        raise UsageError(f"'{name}': Adasum reduces floating-point tensors only; got "
                         f"{source.array.dtype}")
    if source.device != "cpu":
        raise UsageError(f"'{name}': Adasum runs on CPU tensors only in hvdlite; got a "
                         f"tensor on {source.device}. Move it to the CPU first")
    if set_size & (set_size - 1):
        raise UsageError(f"'{name}': Adasum needs a process set whose size is a power of "
                         f"two; this one has {set_size} ranks")


def check_scale(value: float, label: str) -> float:
    if value == 1.0:
        return 1.0
    value = float(value)
    if not math.isfinite(value):
        raise UsageError(f"{label} must be finite, got {value}")
    return value


def check_count(value: Any, label: str, least: int) -> int:
    """A whole number of steps or batches: an int (not a bool) of at least ``least``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise UsageError(f"{label} must be an int of at least {least}, not {value!r}")
    return value


def check_root(root_rank: int, call: Call) -> int:
    """The root's rank within the call's set. ``root_rank`` is a global rank, as in
    Horovod, also for a process set: it must be one of the set's members."""
    root = int(root_rank)
    if call.ranks is None:
        if not 0 <= root < call.set_size:
            raise UsageError(f"root_rank={root_rank} is outside the job's ranks "
                             f"0..{call.set_size - 1}")
        return root
    if root not in call.ranks:
        raise UsageError(f"root_rank={root_rank} is not a member of process set {call.set_id} "
                         f"(ranks {list(call.ranks)}); root_rank is a global rank, as in "
                         "Horovod: pick one of the set's ranks")
    return call.ranks.index(root)


