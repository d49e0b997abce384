"""A CPU stand-in for CuPy and its NCCL binding, for the multi-rank GPU code under a
real ``mpiexec``: hvdlite/backends/{gpu,cuda,nccl,staged}.py and the executor's
device branches run unchanged on it, one process per rank, each rank on a
"GPU" of its own (its local rank), so the NCCL backend chooses NCCL and not
staging. A machine with one GPU can run NCCL at world size 1 only; this is how
the NCCL code's offsets, counts, roots and group calls are checked at 2 and 4
ranks, in every CI run.

What it is:
- Device arrays are NumPy arrays of a subclass (``ndarray``) in host memory.
  ``.data.ptr`` is the real address of the first element; the NCCL stand-in
  reads and writes through such pointers, so a wrong offset or count reads or
  writes other bytes. Every pointer handed out is remembered with the bounds of
  the allocation it lies in, and a range that leaves its allocation, or belongs
  to another rank's "GPU", raises CUDARuntimeError (an illegal address), as a
  wild access on a GPU may.
- Like CuPy's, its ufuncs and functions refuse plain NumPy arrays (host memory
  where device memory belongs), ``get``/``set`` check dtype and shape.
- NCCL is tests/unit/fake_nccl.py's semantics (the same checks: group limits,
  matching collectives, matching sends and receives, root-only reduce, the
  observed ncclAvg tail at one rank) with its world an MPI communicator of the
  members: each group call is one allgather of every rank's operations and
  inputs, so a mismatch is an NcclError on every rank, never a hang.
- Devices, streams and events are tests/unit/fake_cupy.py's.

What it cannot catch: anything about real streams and kernels. Work runs when
it is issued, so a missing wait between the framework's stream and the engine's
shows only in the streams' logs; no race, no kernel bug, no alignment or
vector-width corner (NCCL's own tail was found on a GPU: the stand-in models
it only because it was measured there), no device memory limit, no NCCL
algorithm or protocol choice, no real interconnect timing. Those are what
``make gpu-check`` runs on a GPU machine.
"""
from __future__ import annotations

import bisect
import contextlib
import ctypes
import importlib.machinery
import itertools
import sys
import threading
import types
import weakref
from typing import Any, Optional

import numpy as np

from hvdlite.api.adapter import TensorAdapter
from hvdlite.negotiation.requests import dtype_name, to_dtype
from tests.unit import fake_cupy, fake_nccl

NCCL_VERSION = 22809       # the release GPU machines here run (2.28.9)
_HANDSHAKE_TAG = 7100      # + a communicator's serial (mod 10000), on COMM_WORLD


# --- device memory ----------------------------------------------------------------------

class _Allocations:
    """The allocations a pointer was handed out from: (start, end, device), by start."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.starts: list[int] = []
        self.spans: dict[int, tuple[int, int]] = {}     # start -> (end, device)

    def remember(self, array: np.ndarray, device: int) -> None:
        owner = array
        while isinstance(owner.base, np.ndarray):
            owner = owner.base
        start = owner.__array_interface__["data"][0]
        with self.lock:
            if start not in self.spans:
                bisect.insort(self.starts, start)
                weakref.finalize(owner, self._forget, start)
            self.spans[start] = (start + owner.nbytes, device)

    def _forget(self, start: int) -> None:
        with self.lock:
            if self.spans.pop(start, None) is not None:
                self.starts.remove(start)

    def resolve(self, ptr: int, nbytes: int, device: int) -> np.ndarray:
        """The ``nbytes`` at ``ptr`` as a writable byte array (NCCL's view of it)."""
        if nbytes == 0:
            return np.empty(0, np.uint8)
        with self.lock:
            at = bisect.bisect_right(self.starts, ptr) - 1
            start = self.starts[at] if at >= 0 else None
            end, owner = self.spans[start] if start is not None else (0, -1)
        if start is None or ptr + nbytes > end:
            raise fake_cupy.CUDARuntimeError(
                f"cudaErrorIllegalAddress: {nbytes} bytes at {ptr:#x} leave their allocation")
        if owner != device:
            raise fake_cupy.CUDARuntimeError(
                f"memory of device {owner} used on device {device}")
        return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))


ALLOCATIONS = _Allocations()


def _plain(item: Any) -> Any:
    """Device arrays as plain NumPy views, through lists and tuples; a host array
    where a device array belongs is refused, as CuPy refuses it."""
    if isinstance(item, ndarray):
        return item.view(np.ndarray)
    if isinstance(item, np.ndarray) and item.ndim > 0:
        raise TypeError(f"Unsupported type {type(item)} (a host array where the device "
                        "stand-in expects a device array)")
    if isinstance(item, (list, tuple)):
        return type(item)(_plain(i) for i in item)
    return item


def _device_result(result: Any, device: int) -> Any:
    if isinstance(result, np.ndarray) and not isinstance(result, ndarray):
        wrapped = result.view(ndarray)
        wrapped._device = device
        return wrapped
    if isinstance(result, tuple):
        return tuple(_device_result(r, device) for r in result)
    return result


class ndarray(np.ndarray):  # noqa: N801 (CuPy's name)
    """A device array: host memory, a device number, CuPy's refusals."""
    _device: int

    def __array_finalize__(self, obj: Any) -> None:
        self._device = getattr(obj, "_device", fake_cupy.current_device())

    @property
    def data(self) -> fake_cupy.MemoryPointer:          # type: ignore[override]
        ALLOCATIONS.remember(self, self._device)
        return fake_cupy.MemoryPointer(self.__array_interface__["data"][0], self._device)

    @property
    def device(self) -> fake_cupy.Device:               # type: ignore[override]
        return fake_cupy.Device(self._device)

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        out = kwargs.get("out")
        if out is not None:
            kwargs["out"] = _plain(out)
        result = getattr(ufunc, method)(*_plain(inputs), **kwargs)
        if out is not None:
            return out[0] if len(out) == 1 else out
        return _device_result(result, self._device)

    def __array_function__(self, func: Any, types_: Any, args: Any, kwargs: Any) -> Any:
        out = kwargs.get("out")
        result = func(*_plain(args), **{k: _plain(v) for k, v in kwargs.items()})
        return out if out is not None else _device_result(result, self._device)

    def get(self, stream: Any = None, out: Optional[np.ndarray] = None) -> np.ndarray:
        plain = self.view(np.ndarray)
        if out is None:
            return plain.copy()
        if out.dtype != self.dtype or out.shape != self.shape:
            raise ValueError(f"get into {out.dtype}{out.shape} from {self.dtype}{self.shape}")
        out[...] = plain
        return out

    def set(self, arr: np.ndarray, stream: Any = None) -> None:
        if isinstance(arr, ndarray) or arr.dtype != self.dtype or arr.shape != self.shape:
            raise ValueError(f"set {type(arr).__name__} {arr.dtype}{arr.shape} into "
                             f"{self.dtype}{self.shape}")
        self.view(np.ndarray)[...] = arr


def _on_device(array: np.ndarray) -> ndarray:
    return _device_result(np.ascontiguousarray(array), fake_cupy.current_device())


def asarray(a: Any, dtype: Any = None) -> ndarray:
    if isinstance(a, ndarray) and dtype in (None, a.dtype):
        return a
    return _on_device(np.array(_plain(a) if isinstance(a, ndarray) else a, dtype=dtype))


def _made_by(name: str) -> Any:
    numpy_function = getattr(np, name)

    def make(*args: Any, **kwargs: Any) -> ndarray:
        return _on_device(numpy_function(*_plain(args), **kwargs))
    make.__name__ = name
    return make


class _Namespace(types.ModuleType):
    """``cupy``: the names above, creation functions on the current device, and
    every other NumPy function, which refuses host arrays through ``ndarray``."""

    def __getattr__(self, name: str) -> Any:
        if name in ("empty", "zeros", "ones", "full", "arange", "empty_like", "zeros_like",
                    "ascontiguousarray", "array"):
            return _made_by(name)
        return getattr(np, name)


# --- NCCL over MPI ---------------------------------------------------------------------

def _mpi() -> Any:
    """mpi4py's MPI, imported at the first NCCL call: under torchrun, whose GPU sets
    run on torch's NCCL (here Gloo, ``TorchStandIn``), none is needed."""
    from mpi4py import MPI
    return MPI


_serials = itertools.count(1)


def get_unique_id() -> tuple:
    """128 C chars naming the caller's world rank and a serial of its own."""
    header = np.array([_mpi().COMM_WORLD.Get_rank(), next(_serials)], np.int64).tobytes()
    return tuple(np.frombuffer(header + bytes(112), np.int8).tolist())


def _members(root: int, serial: int, ndev: int, rank: int) -> list[int]:
    """World ranks of the communicator's ranks 0..ndev-1, told by its root (the
    rank that made the id), which hears from each of the others."""
    world, tag = _mpi().COMM_WORLD, _HANDSHAKE_TAG + serial % 10000
    if rank != 0:
        world.send((rank, world.Get_rank()), dest=root, tag=tag)
        return world.recv(source=root, tag=tag)
    members = [world.Get_rank()] + [-1] * (ndev - 1)
    for _ in range(ndev - 1):
        theirs, world_rank = world.recv(source=_mpi().ANY_SOURCE, tag=tag)
        members[theirs] = world_rank
    for world_rank in members[1:]:
        world.send(members, dest=world_rank, tag=tag)
    return members


class _MpiWorld:
    """The meeting point of fake_nccl's group calls: one allgather per call."""

    def __init__(self, comm: Any) -> None:
        self.comm, self.size = comm, comm.Get_size()

    def exchange(self, rank: int, item: Any) -> list[Any]:
        return self.comm.allgather(item)

    def abort(self) -> None:
        """Nothing to wake: a failed rank still takes part in the exchange."""


class NcclCommunicator(fake_nccl.NcclCommunicator):
    def __init__(self, ndev: int, commId: tuple, rank: int) -> None:  # noqa: N803
        if not isinstance(commId, tuple) or len(commId) != 128:
            raise fake_nccl.NcclError("invalid unique id")
        root, serial = np.frombuffer(np.array(commId, np.int8).tobytes()[:16], np.int64)
        members = _members(int(root), int(serial), ndev, rank)
        group = _mpi().COMM_WORLD.Get_group().Incl(members)
        comm = _mpi().COMM_WORLD.Create_group(group, tag=_HANDSHAKE_TAG + int(serial) % 10000)
        group.Free()
        self.rank, self.size, self.device = rank, ndev, fake_cupy.current_device()
        self._world = _MpiWorld(comm)
        places = comm.allgather((fake_cupy.hostname(), self.device))
        if len(set(places)) < ndev:
            raise fake_nccl.NcclError("ncclInvalidUsage: Duplicate GPU detected")
        self.alive = True

    def destroy(self) -> None:
        if self.alive:
            self.alive = False
            self._world.comm.Free()


# --- installing it -----------------------------------------------------------------------

def _module(name: str, **attributes: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    return module


def install() -> types.ModuleType:
    """Make ``import cupy`` (and cupy.cuda, its runtime and nccl) the stand-in in this
    process; returns ``cupy``. Call before hvdlite first meets a "cuda" device."""
    fake_nccl.use_memory(ALLOCATIONS.resolve)
    fake_nccl._state = fake_nccl._State(NCCL_VERSION)
    nccl = _module("cupy.cuda.nccl", NcclCommunicator=NcclCommunicator,
                   get_unique_id=get_unique_id, get_version=lambda: NCCL_VERSION,
                   groupStart=fake_nccl.groupStart, groupEnd=fake_nccl.groupEnd,
                   NcclError=fake_nccl.NcclError,
                   **{name: getattr(fake_nccl, name) for name in
                      ("NCCL_SUM", "NCCL_PROD", "NCCL_MAX", "NCCL_MIN", "NCCL_AVG")},
                   **fake_nccl._TYPE_NAMES)
    runtime = _module("cupy.cuda.runtime", streamWaitEvent=fake_cupy._stream_wait_event,
                      CUDARuntimeError=fake_cupy.CUDARuntimeError,
                      getDeviceCount=lambda: fake_cupy.DEVICE_COUNT)
    cuda = _module("cupy.cuda", Device=fake_cupy.Device, Stream=fake_cupy.Stream,
                   Event=fake_cupy.Event, runtime=runtime, nccl=nccl,
                   alloc_pinned_memory=fake_cupy.alloc_pinned_memory,
                   get_current_stream=fake_cupy.get_current_stream,
                   MemoryPointer=fake_cupy.MemoryPointer)
    cupy = _Namespace("cupy")
    cupy.__dict__.update(ndarray=ndarray, asarray=asarray, cuda=cuda)
    modules = {"cupy": cupy, "cupy.cuda": cuda, "cupy.cuda.runtime": runtime,
               "cupy.cuda.nccl": nccl}
    for name, module in modules.items():     # importlib.util.find_spec reads it
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    sys.modules.update(modules)
    from hvdlite.backends import torch_nccl     # imports cupy: the stand-in's, from here on
    torch_nccl.DEVICE = TorchStandIn
    return cupy


class TorchStandIn:
    """hvdlite/backends/torch_nccl.py's ``DEVICE`` on the stand-in (torchrun runs): the
    device arrays' host memory as CPU tensors, Gloo groups of the set's members in
    NCCL's place, and no stream to make current (work runs when it is issued)."""
    group_backend = "gloo"

    @staticmethod
    def tensor(buf: Any) -> Any:
        import torch
        raw = buf.reshape(-1).view(np.ndarray).view(np.uint8)
        return torch.from_numpy(raw).view(getattr(torch, buf.dtype.name))

    @staticmethod
    def on_engine_stream() -> Any:
        return contextlib.nullcontext()


def use_device(index: int) -> None:
    """Make GPU ``index`` this thread's current device, with a stream of its own as
    the current stream (a framework's compute stream, which results are fenced on)."""
    fake_cupy.Device(index).use()
    fake_cupy.Stream().use()


# Bugs planted in a GPU backend's own source (STANDIN_PLANT=name), to show that the
# stand-in catches them: (module, text as it is, text with the bug). nccl.py's run under
# mpiexec; torch_nccl.py's under torchrun (tests/integration/test_standin_plants.py).
PLANTS = {
    "reducescatter-offset": ("nccl", "buf.data.ptr + start * itemsize", "buf.data.ptr + start"),
    "allgather-count": ("nccl", "recv.data.ptr + start, count, kind, root",
                        "recv.data.ptr + start, max(count - 1, 0), kind, root"),
    "allreduce-count": ("nccl", "target.data.ptr, target.size,", "target.data.ptr, target.nbytes,"),
    "torch-allgather-padding": ("torch_nccl", "gathered[rank * longest: rank * longest + count]",
                                "gathered[rank * count: rank * count + count]"),
    "torch-reducescatter-start": ("torch_nccl", "start = sum(counts[:me])",
                                  "start = me * counts[me]"),
    "torch-broadcast-root": ("torch_nccl", "options.rootRank, options.rootTensor = root, 0",
                             "options.rootRank, options.rootTensor = 0, 0"),
}


def plant(name: str) -> None:
    """Load the GPU backend module with bug ``name`` in its source, in its place."""
    import hvdlite.backends
    module_name, correct, planted = PLANTS[name]
    path = f"{hvdlite.backends.__path__[0]}/{module_name}.py"
    with open(path, encoding="utf-8") as file:
        source = file.read()
    if correct not in source:
        raise AssertionError(f"plant {name!r}: {correct!r} is no longer in {path}; "
                             "update PLANTS to today's code")
    module = types.ModuleType(f"hvdlite.backends.{module_name}")
    module.__file__ = path
    sys.modules[module.__name__] = module
    exec(compile(source.replace(correct, planted), path, "exec"), module.__dict__)
    if module_name == "torch_nccl":
        module.DEVICE = TorchStandIn


class StandInAdapter(TensorAdapter):
    """hvdlite's tensor adapter for the stand-in's device arrays (``make_ops`` of it
    is a binding on "CUDA" arrays, as hvdlite.torch is on CUDA tensors)."""
    framework = "cupy-standin"
    accepted = "stand-in device array"

    def is_tensor(self, obj: Any) -> bool:
        return isinstance(obj, ndarray)

    def to_array(self, tensor: Any) -> Any:
        return tensor

    def from_array(self, array: Any) -> Any:
        return array

    def device(self, tensor: Any) -> str:
        return f"cuda:{tensor._device}"

    def ready_event(self, tensor: Any) -> Any:
        with fake_cupy.Device(tensor._device):
            event = fake_cupy.Event(disable_timing=True)
            event.record(fake_cupy.get_current_stream())
        return event

    def wait_fence(self, fence: Any) -> None:
        fake_cupy._stream_wait_event(fake_cupy.get_current_stream().ptr, fence.ptr, 0)

    def cast(self, tensor: Any, dtype: str) -> Any:
        return tensor.astype(to_dtype(dtype))

    def dtype_name(self, tensor: Any) -> str:
        return dtype_name(tensor.dtype)

    def is_floating(self, tensor: Any) -> bool:
        return tensor.dtype.name == "bfloat16" or np.issubdtype(tensor.dtype, np.floating)

