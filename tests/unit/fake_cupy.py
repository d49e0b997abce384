"""A NumPy stand-in for the part of CuPy that the GPU backends use
(hvdlite/backends/gpu.py, cuda.py, nccl.py, staged.py), so that they run in one
process on a CPU, one thread per rank as tests/unit/fake_comm.py runs MPI; NCCL's
part is tests/unit/fake_nccl.py. Found necessary by make mutate: the real GPU
tests need a GPU, which neither this machine nor CI has, so no mutant of those
modules could be judged.

What is faithful, because the backends' correctness rests on it:
- Device memory is raw bytes at fake addresses far apart; ``.data.ptr`` is an
  address, and what reads through a pointer (NCCL) reads the bytes there: a
  wrong offset, count or datatype reads other bytes, and a range past its
  allocation raises (an illegal address). An allocation is 256-byte aligned,
  all that CUDA promises, and no more: bits 8 to 19 of every base are set (one
  legal placement), so a base combined with an offset of 256 bytes or more by
  anything but addition (``|`` or ``^``, say) lands elsewhere, as it can on a GPU.
- Arrays refuse implicit conversion to NumPy, as CuPy's do; ``get``/``set``
  check dtype and shape as CuPy >= 13 does (``get`` blocks by default).
- The current device is per thread (CUDA's is); a stream belongs to the device
  current when it was made, and a copy on another device's stream raises.
- Pinned memory is a ``PinnedMemory`` (a bytearray): ``is_pinned`` tells a
  staged copy's host buffer from pageable memory.

What is not: work runs when it is issued (a stream is a log, ``Stream.log``), so
a missing wait between streams shows only in that log, and an event is done once
recorded unless its stream is ``busy`` (then at a synchronize). Rank threads on
one GPU ordinal share what a module keeps per process (cuda.py's streams).
Anything not named here is absent: using it raises AttributeError or TypeError.
"""
from __future__ import annotations

import bisect
import itertools
import socket
import sys
import threading
import types
from typing import Any, Optional

import numpy as np
import pytest

DEVICE_COUNT = 8

class CUDARuntimeError(RuntimeError):
    pass


class _State:
    """Everything the fake remembers; ``install`` starts a fresh one per test."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.bases: list[int] = []                  # device allocations, ascending
        self.memory: list[_Memory] = []
        self.next_address = 1 << 40                 # 1 MiB aligned; see _Memory
        self.handles: dict[int, Any] = {}           # stream and event pointers
        self.next_handle = itertools.count(0x7000, 0x10)
        self.pinned: list[int] = []                 # sizes asked of alloc_pinned_memory


_state = _State()
_local = threading.local()     # device, streams (current, null), host; NCCL's group


def _handle(obj: Any) -> int:
    with _state.lock:
        ptr = next(_state.next_handle)
        _state.handles[ptr] = obj
    return ptr


def current_device() -> int:
    return getattr(_local, "device", 0)


def hostname() -> str:
    """This thread's host (``set_host`` makes rank threads look like several nodes)."""
    return getattr(_local, "host", socket.gethostname())


def set_host(name: str) -> None:
    _local.host = name


# --- devices, streams, events ------------------------------------------------------

class Device:
    def __init__(self, device: Optional[int] = None) -> None:
        self.id = current_device() if device is None else int(device)
        if not 0 <= self.id < DEVICE_COUNT:
            raise CUDARuntimeError(f"cudaErrorInvalidDevice: device {self.id}")
        self._previous: list[int] = []

    def use(self) -> None:
        _local.device = self.id

    def __enter__(self) -> "Device":
        self._previous.append(current_device())
        self.use()
        return self

    def __exit__(self, *exc: Any) -> None:
        _local.device = self._previous.pop()


class Stream:
    """A stream of the device current at its creation; ``log`` lists what was issued
    on it. ``busy``: events recorded meanwhile are not done until synchronized."""

    def __init__(self, non_blocking: bool = False) -> None:
        self.device = current_device()
        self.non_blocking = non_blocking
        self.ptr = _handle(self)
        self.log: list[tuple] = []
        self.busy = False
        self._events: list[Event] = []

    def use(self) -> "Stream":
        _streams()[self.device] = self
        return self

    def synchronize(self) -> None:
        self.log.append(("synchronize",))
        for event in self._events:
            event._done = True


def _null_stream(device: int) -> Stream:
    """The legacy default stream of ``device`` (pointer 0), as this thread sees it."""
    if not hasattr(_local, "nulls"):
        _local.nulls = {}
    stream = _local.nulls.get(device)
    if stream is None:
        stream = _local.nulls[device] = Stream.__new__(Stream)
        stream.device, stream.non_blocking, stream.ptr = device, False, 0
        stream.log, stream.busy, stream._events = [], False, []
    return stream


def _streams() -> dict[int, Stream]:
    if not hasattr(_local, "streams"):
        _local.streams = {}
    return _local.streams


def get_current_stream() -> Stream:
    device = current_device()
    return _streams().get(device) or _null_stream(device)


def stream_of(ptr: int, device: int) -> Stream:
    """The stream a raw pointer names; it must belong to ``device``."""
    stream = _null_stream(device) if ptr == 0 else _state.handles.get(ptr)
    if not isinstance(stream, Stream):
        raise CUDARuntimeError(f"cudaErrorInvalidResourceHandle: stream {ptr:#x}")
    if stream.device != device:
        raise CUDARuntimeError(f"stream of device {stream.device} used on device {device}")
    return stream


class Event:
    def __init__(self, disable_timing: bool = False) -> None:
        self.disable_timing = disable_timing
        self.ptr = _handle(self)
        self.stream: Optional[Stream] = None
        self._done = True             # CUDA: an event never recorded is complete

    def record(self, stream: Optional[Stream] = None) -> None:
        self.stream = get_current_stream() if stream is None else stream
        self.stream.log.append(("record", self))
        self._done = not self.stream.busy
        self.stream._events.append(self)

    @property
    def done(self) -> bool:
        return self._done

    def synchronize(self) -> None:
        self._done = True


def _stream_wait_event(stream: int, event: int, flags: int) -> None:
    waiter, awaited = _state.handles.get(stream), _state.handles.get(event)
    if not isinstance(waiter, Stream) or not isinstance(awaited, Event) or flags != 0:
        raise CUDARuntimeError(f"cudaStreamWaitEvent({stream:#x}, {event:#x}, {flags})")
    waiter.log.append(("wait", awaited))


# --- memory --------------------------------------------------------------------------

_LOW_BITS = (1 << 20) - 256      # an allocation's address modulo 1 MiB: bits 8 to 19 set


class _Memory:
    def __init__(self, nbytes: int, device: int) -> None:
        self.raw = np.zeros(nbytes, np.uint8)
        self.device = device
        with _state.lock:
            self.base = _state.next_address + _LOW_BITS
            end = self.base + nbytes + (1 << 20)         # far apart: a gap of 1 MiB at least
            _state.next_address = (end + (1 << 20) - 1) >> 20 << 20
            _state.bases.append(self.base)
            _state.memory.append(self)


def resolve(ptr: int, nbytes: int, device: int) -> np.ndarray:
    """The ``nbytes`` of device memory at ``ptr`` (raw bytes), on GPU ``device``."""
    with _state.lock:
        at = bisect.bisect_right(_state.bases, ptr) - 1
        memory = _state.memory[at] if at >= 0 else None
    if memory is None or ptr + nbytes > memory.base + memory.raw.size:
        raise CUDARuntimeError(f"cudaErrorIllegalAddress: {nbytes} bytes at {ptr:#x}")
    if memory.device != device:
        raise CUDARuntimeError(f"memory of device {memory.device} used on device {device}")
    start = ptr - memory.base
    return memory.raw[start: start + nbytes]


class MemoryPointer:
    def __init__(self, ptr: int, device: int) -> None:
        self.ptr, self.device_id = ptr, device


class ndarray:  # noqa: N801 (CuPy's name)
    """A C-contiguous array in fake device memory."""

    def __init__(self, shape: Any, dtype: Any = float) -> None:
        self.shape = (int(shape),) if np.ndim(shape) == 0 else tuple(int(n) for n in shape)
        self.dtype = np.dtype(dtype)
        self._memory = _Memory(self.nbytes, current_device())

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def data(self) -> MemoryPointer:
        return MemoryPointer(self._memory.base, self._memory.device)

    def _view(self) -> np.ndarray:
        return self._memory.raw.view(self.dtype).reshape(self.shape)

    def _copy_stream(self, stream: Optional[Stream]) -> Stream:
        stream = get_current_stream() if stream is None else stream
        if stream.device != self._memory.device:
            raise CUDARuntimeError(f"a copy of device {self._memory.device}'s memory on a "
                                   f"stream of device {stream.device}")
        return stream

    def get(self, stream: Optional[Stream] = None, out: Optional[np.ndarray] = None) -> np.ndarray:
        stream = self._copy_stream(stream)
        if out is None:
            out = np.empty(self.shape, self.dtype)
        elif not isinstance(out, np.ndarray):
            raise TypeError("Only numpy.ndarray can be obtained from cupy.ndarray")
        elif out.dtype != self.dtype:
            raise TypeError(f"{out.dtype} array cannot be obtained from {self.dtype} array")
        elif out.shape != self.shape:
            raise ValueError(f"Shape mismatch. Expected shape: {self.shape}, "
                             f"actual shape: {out.shape}")
        elif not out.flags.c_contiguous:
            raise NotImplementedError("the fake copies into C-contiguous arrays only")
        out[...] = self._view()
        stream.log.append(("get", self.nbytes, is_pinned(out)))
        return out

    def set(self, arr: np.ndarray, stream: Optional[Stream] = None) -> None:
        if not isinstance(arr, np.ndarray):
            raise TypeError("Only numpy.ndarray can be set to cupy.ndarray")
        if arr.dtype != self.dtype:
            raise TypeError(f"{arr.dtype} array cannot be set to {self.dtype} array")
        if arr.shape != self.shape:
            raise ValueError(f"Shape mismatch. Old shape: {self.shape}, new shape: {arr.shape}")
        stream = self._copy_stream(stream)
        self._view()[...] = arr
        stream.log.append(("set", self.nbytes, is_pinned(arr)))

    def __array__(self, *args: Any, **kwargs: Any) -> np.ndarray:
        raise TypeError("Implicit conversion to a NumPy array is not allowed. "
                        "Please use `.get()` to construct a NumPy array explicitly.")

    def __repr__(self) -> str:
        return f"fake_cupy.ndarray({self._view()!r}, device={self._memory.device})"


def empty(shape: Any, dtype: Any = float) -> ndarray:
    return ndarray(shape, dtype)


def zeros(shape: Any, dtype: Any = float) -> ndarray:
    return ndarray(shape, dtype)          # fresh fake memory is zeroed


def asarray(a: Any, dtype: Any = None) -> ndarray:
    """A device copy of host data (on the current device)."""
    if isinstance(a, ndarray) and dtype in (None, a.dtype):
        return a
    host = np.ascontiguousarray(a, dtype=dtype)
    array = ndarray(host.shape, host.dtype)
    array._view()[...] = host
    return array


class PinnedMemory(bytearray):
    """Page-locked host memory: what CuPy's alloc_pinned_memory returns, for the
    buffer protocol (np.frombuffer)."""


def alloc_pinned_memory(nbytes: int) -> PinnedMemory:
    _state.pinned.append(int(nbytes))
    return PinnedMemory(int(nbytes))


def is_pinned(array: np.ndarray) -> bool:
    base: Any = array
    while isinstance(base, np.ndarray):
        base = base.base
    return isinstance(getattr(base, "obj", base), PinnedMemory)


# --- installing it as ``cupy`` ---------------------------------------------------------

def _module(name: str, **attributes: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    return module


def install(monkeypatch: pytest.MonkeyPatch, nccl_version: Optional[int] = 21805
            ) -> types.ModuleType:
    """Put a fresh fake ``cupy`` (and ``cupy.cuda``, ``cupy.cuda.runtime``, and
    ``cupy.cuda.nccl`` of that version unless it is None) in sys.modules until the
    test ends; returns the ``cupy`` module."""
    from tests.unit import fake_nccl       # it imports this module
    monkeypatch.setattr(sys.modules[__name__], "_state", _State())
    for attribute in ("device", "streams", "nulls", "group", "depth", "host"):
        if hasattr(_local, attribute):     # the test's own thread, from an earlier test
            delattr(_local, attribute)
    runtime = _module("cupy.cuda.runtime", streamWaitEvent=_stream_wait_event,
                      CUDARuntimeError=CUDARuntimeError)
    cuda = _module("cupy.cuda", Device=Device, Stream=Stream, Event=Event, runtime=runtime,
                   alloc_pinned_memory=alloc_pinned_memory,
                   get_current_stream=get_current_stream, MemoryPointer=MemoryPointer)
    cupy = _module("cupy", ndarray=ndarray, empty=empty, zeros=zeros, asarray=asarray,
                   cuda=cuda)
    modules = {"cupy": cupy, "cupy.cuda": cuda, "cupy.cuda.runtime": runtime}
    if nccl_version is None:               # `from cupy.cuda import nccl` fails
        monkeypatch.delitem(sys.modules, "cupy.cuda.nccl", raising=False)
    else:
        cuda.nccl = modules["cupy.cuda.nccl"] = fake_nccl.module(monkeypatch, nccl_version)
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    return cupy


def state() -> _State:
    return _state
