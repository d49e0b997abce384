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

    def to_array(self, tensor: torch.Tensor) -> np.ndarray:
        if tensor.device.type != "cpu":
            raise HvdliteTypeError(
                f"hvdlite.torch handles CPU tensors; got a tensor on {tensor.device}. Move it "
                "with .cpu() (the GPU path is not part of this build).")
        if tensor.is_sparse:
            raise HvdliteTypeError("hvdlite.torch collectives take dense tensors; call "
                                   ".to_dense() on a sparse tensor first")
        detached = tensor.detach()
        if detached.dtype is torch.bfloat16:
            return detached.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return detached.numpy()

    def from_array(self, array: Any) -> torch.Tensor:
        if isinstance(array, np.ndarray) and array.dtype == ml_dtypes.bfloat16:
            return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(np.asarray(array))

    def device(self, tensor: torch.Tensor) -> str:
        return "cpu" if tensor.device.type == "cpu" else str(tensor.device)

    def cast(self, tensor: torch.Tensor, dtype: str) -> torch.Tensor:
        return tensor.to(_BY_NAME.get(dtype) or getattr(torch, dtype))

    def dtype_name(self, tensor: torch.Tensor) -> str:
        return str(tensor.dtype).removeprefix("torch.")

    def is_floating(self, tensor: torch.Tensor) -> bool:
        return tensor.dtype.is_floating_point


TORCH = register(TorchAdapter())
