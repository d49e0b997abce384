"""The torch tensor adapter: CPU tensors cross into the core as NumPy views of
their own memory (no copy, strides kept; bfloat16 travels as its bit pattern
through ml_dtypes), and results come back as tensors sharing the arrays."""
from __future__ import annotations

import itertools
import math
from typing import Any, Sequence

import ml_dtypes
import numpy as np
import torch

from hvdlite.api.adapter import TensorAdapter, register
from hvdlite.errors import HvdliteTypeError

_BY_NAME = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
            "float64": torch.float64}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> "float32", the name the core and NumPy use."""
    return str(dtype).removeprefix("torch.")


class TorchAdapter(TensorAdapter):
    framework = "torch"
    accepted = "torch.Tensor"
    _waited: tuple[Any, int] = (None, 0)     # the last fence a stream was made to wait on

    def is_tensor(self, obj: Any) -> bool:
        return isinstance(obj, torch.Tensor)

    def to_array(self, tensor: torch.Tensor) -> Any:
        if tensor.is_sparse:
            raise HvdliteTypeError("hvdlite.torch collectives take dense tensors; call "
                                   ".to_dense() on a sparse tensor first")
        detached = tensor.detach()
        if tensor.device.type == "cuda":
            return _cupy_view(detached)             # zero-copy, strides kept
        if tensor.device.type != "cpu":
            raise HvdliteTypeError(f"hvdlite.torch handles CPU and CUDA tensors; got a "
                                   f"tensor on {tensor.device}")
        if detached.dtype is torch.bfloat16:
            return detached.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return detached.numpy()

    def from_array(self, array: Any) -> torch.Tensor:
        if not isinstance(array, np.ndarray):
            return torch.from_dlpack(array)        # a CuPy array: zero-copy
        if array.dtype == ml_dtypes.bfloat16:
            return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(array)

    def device(self, tensor: torch.Tensor) -> str:
        if tensor.device.type == "cuda":
            index = tensor.device.index
            return f"cuda:{torch.cuda.current_device() if index is None else index}"
        return "cpu"

    def ready_event(self, tensor: torch.Tensor) -> Any:
        cupy = _cupy()
        with cupy.cuda.Device(tensor.device.index):
            event = cupy.cuda.Event(disable_timing=True)
            cupy.cuda.runtime.eventRecord(event.ptr, _current_stream(tensor.device.index))
        return event

    def contiguous(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach().contiguous()

    def wait_fence(self, fence: Any) -> None:
        stream = _current_stream(torch.cuda.current_device())
        if self._waited == (fence, stream):
            return                # a group's results share one fence: one wait is enough
        _cupy().cuda.runtime.streamWaitEvent(stream, fence.ptr, 0)
        self._waited = (fence, stream)

    def cast(self, tensor: torch.Tensor, dtype: str) -> torch.Tensor:
        return tensor.to(_BY_NAME.get(dtype) or getattr(torch, dtype))

    def nbytes(self, tensor: torch.Tensor) -> int:
        return tensor.numel() * tensor.element_size()

    def dtype_name(self, tensor: torch.Tensor) -> str:
        return dtype_name(tensor.dtype)

    def is_floating(self, tensor: torch.Tensor) -> bool:
        return tensor.dtype.is_floating_point

    # Flat buffers are torch tensors on the gradients' device: .grad can view them.
    @property
    def buffers(self) -> "TorchAdapter":
        return self

    def flat_buffer(self, dtype: str, device: str, count: int) -> torch.Tensor:
        return torch.zeros(count, dtype=getattr(torch, dtype), device=device)

    def view(self, flat: torch.Tensor, offset: int, shape: tuple[int, ...]) -> torch.Tensor:
        return flat[offset:offset + math.prod(shape)].view(shape)

    def pack(self, tensors: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
        offset = 0
        with torch.no_grad():
            for tensor in tensors:       # any strides: one copy each, no contiguous copy
                self.view(flat, offset, tuple(tensor.shape)).copy_(tensor)
                offset += tensor.numel()

    def unpack(self, flat: torch.Tensor, shapes: Sequence[tuple[int, ...]]) -> list[torch.Tensor]:
        """Views of ``flat``: no copy (valid until ``flat`` is written again)."""
        offsets = itertools.accumulate((math.prod(shape) for shape in shapes), initial=0)
        return [self.view(flat, offset, shape) for offset, shape in zip(offsets, shapes)]


def _current_stream(index: Any) -> int:
    """The raw pointer of the framework's current stream on GPU ``index``.
    torch.cuda.current_stream() builds a Stream object and resolves the device
    (~15 us a call, three calls per collective); the raw query is one C call."""
    if index is None:
        index = torch.cuda.current_device()
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw(index) if raw is not None else torch.cuda.current_stream(index).cuda_stream


_CUPY_DTYPES = {torch.float16: np.float16, torch.bfloat16: ml_dtypes.bfloat16,
                torch.float32: np.float32, torch.float64: np.float64, torch.int8: np.int8,
                torch.uint8: np.uint8, torch.int16: np.int16, torch.int32: np.int32,
                torch.int64: np.int64, torch.bool: np.bool_, torch.complex64: np.complex64,
                torch.complex128: np.complex128}


def _cupy_view(tensor: torch.Tensor) -> Any:
    """A CuPy array over a CUDA tensor's memory, built directly from its pointer,
    shape and strides (DLPack's exchange costs ~35 us a call; this ~5 us). The
    memory object holds the tensor, so the array keeps it alive."""
    cupy = _cupy()
    dtype = _CUPY_DTYPES.get(tensor.dtype)
    if dtype is None:
        return cupy.from_dlpack(tensor)
    itemsize = tensor.element_size()
    span = (sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride())) + 1
            if tensor.numel() else 0) * itemsize
    memory = cupy.cuda.UnownedMemory(tensor.data_ptr(), span, tensor, tensor.device.index)
    return cupy.ndarray(tuple(tensor.shape), dtype, cupy.cuda.MemoryPointer(memory, 0),
                        strides=tuple(s * itemsize for s in tensor.stride()))


def _cupy() -> Any:
    try:
        import cupy
    except ImportError:
        raise HvdliteTypeError("CUDA tensors need CuPy: pip install 'hvdlite[cuda13]' "
                               "(or [cuda12], matching your CUDA)") from None
    return cupy


TORCH = register(TorchAdapter())
