"""Wire compression for allreduce: cast floating tensors down, restore after.
Integer (and already-small) tensors are left alone."""
from __future__ import annotations

from typing import Any

import torch


class Compressor:
    """Interface: compress(tensor) -> (tensor, context); decompress(tensor, context)."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, context: Any) -> torch.Tensor:
        return tensor


class NoneCompressor(Compressor):
    pass


class _CastCompressor(Compressor):
    wire_dtype: torch.dtype = torch.float16

    @classmethod
    def compress(cls, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if tensor.dtype.is_floating_point and tensor.dtype.itemsize > cls.wire_dtype.itemsize:
            return tensor.to(cls.wire_dtype), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, context: Any) -> torch.Tensor:
        return tensor if context is None else tensor.to(context)


class FP16Compressor(_CastCompressor):
    wire_dtype = torch.float16


class BF16Compressor(_CastCompressor):
    wire_dtype = torch.bfloat16


class Compression:
    """``Compression.none``, ``Compression.fp16``, ``Compression.bf16``."""
    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
