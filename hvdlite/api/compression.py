"""Wire compression for reductions, for every framework: cast floating tensors
down to 16 bits for the wire and restore them after. Integer (and already
small) tensors are left alone. The tensor's adapter does the cast, so the
same ``Compression.fp16`` serves NumPy, torch and TensorFlow tensors."""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from hvdlite.api.adapter import adapter_for
from hvdlite.errors import HvdliteTypeError


class Compressor:
    """Interface: compress(tensor) -> (tensor, context); decompress(tensor, context)."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, context: Any) -> Any:
        return tensor


class NoneCompressor(Compressor):
    pass


class _CastCompressor(Compressor):
    wire_dtype = "float16"
    wire_itemsize = 2

    @classmethod
    def compress(cls, tensor: Any) -> tuple[Any, Any]:
        adapter = adapter_for(tensor)
        if adapter is None:
            raise HvdliteTypeError(f"cannot compress a {type(tensor).__name__}; pass a tensor")
        dtype = adapter.dtype_name(tensor)
        if adapter.is_floating(tensor) and _itemsize(dtype) > cls.wire_itemsize:
            return adapter.cast(tensor, cls.wire_dtype), (adapter, dtype)
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, context: Any) -> Any:
        if context is None:
            return tensor
        adapter, dtype = context
        return adapter.cast(tensor, dtype)


def _itemsize(dtype: str) -> int:
    from hvdlite.negotiation.requests import to_dtype
    return to_dtype(dtype).itemsize


class FP16Compressor(_CastCompressor):
    wire_dtype = "float16"


class BF16Compressor(_CastCompressor):
    wire_dtype = "bfloat16"


class Compression:
    """``Compression.none``, ``Compression.fp16``, ``Compression.bf16``."""
    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor


def compressed(compression: Optional[type[Compressor]], tensor: Any,
               run: Callable[[Any], Any]) -> Any:
    """``run`` on the tensor as compressed for the wire; the result restored."""
    compression = compression or Compression.none
    wire, context = compression.compress(tensor)
    return compression.decompress(run(wire), context)


def compressed_all(compression: Optional[type[Compressor]], tensors: Sequence[Any],
                   run: Callable[[list[Any]], Sequence[Any]]) -> list[Any]:
    """``compressed`` for a group: ``run`` takes and returns one tensor per input."""
    compression = compression or Compression.none
    wires = [compression.compress(t) for t in tensors]
    results = run([wire for wire, _ in wires])
    return [compression.decompress(r, context) for r, (_, context) in zip(results, wires)]

