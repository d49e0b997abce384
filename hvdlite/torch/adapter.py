"""The torch tensor adapter: CPU tensors cross into the core as NumPy views of
their own memory (no copy, strides kept; bfloat16 travels as its bit pattern
through ml_dtypes), and results come back as tensors sharing the arrays."""
from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import torch

from hvdlite.api.adapter import TensorAdapter, register
from hvdlite.errors import HvdliteTypeError

_BY_NAME = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
            "float64": torch.float64}


class TorchAdapter(TensorAdapter):
    framework = "torch"
    accepted = "torch.Tensor"

    def is_tensor(self, obj: Any) -> bool:
        return isinstance(obj, torch.Tensor)

    def to_array(self, tensor: torch.Tensor) -> Any:
        if tensor.is_sparse:
            raise HvdliteTypeError("hvdlite.torch collectives take dense tensors; call "
                                   ".to_dense() on a sparse tensor first")
        detached = tensor.detach()
        if tensor.device.type == "cuda":
            return _cupy().from_dlpack(detached)    # zero-copy, strides kept
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
        return _ReadyEvent(tensor.device)

    def wait_fence(self, fence: Any) -> None:
        stream = torch.cuda.current_stream()
        _cupy().cuda.runtime.streamWaitEvent(stream.cuda_stream, fence.ptr, 0)

    def cast(self, tensor: torch.Tensor, dtype: str) -> torch.Tensor:
        return tensor.to(_BY_NAME.get(dtype) or getattr(torch, dtype))

    def dtype_name(self, tensor: torch.Tensor) -> str:
        return str(tensor.dtype).removeprefix("torch.")

    def is_floating(self, tensor: torch.Tensor) -> bool:
        return tensor.dtype.is_floating_point


class _ReadyEvent:
    """An event recorded now on the tensor's current stream; ``ptr`` is the raw
    cudaEvent_t the engine's stream waits on (the event lives as long as this)."""
    __slots__ = ("event", "ptr")

    def __init__(self, device: torch.device) -> None:
        self.event = torch.cuda.Event()
        self.event.record(torch.cuda.current_stream(device))
        self.ptr = self.event.cuda_event


def _cupy() -> Any:
    try:
        import cupy
    except ImportError:
        raise HvdliteTypeError("CUDA tensors need CuPy: pip install 'hvdlite[cuda13]' "
                               "(or [cuda12], matching your CUDA)") from None
    return cupy


TORCH = register(TorchAdapter())
