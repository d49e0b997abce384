"""Tensor adapters: the one thing a framework binding must write to reach the core.

An adapter says which objects are its tensors, gives the core a NumPy (or
CuPy) array over a tensor's memory without copying where the memory allows,
turns result arrays back into tensors, names the tensor's device, and casts
(for wire compression). The binding factory (``hvdlite.api.binding``) builds
every collective, its ``_async`` and in-place forms from an adapter.

Gradient buckets (``hvdlite.reducer``) also come through it: a flat buffer on a
device, a view of a slice with a shape, and a list of tensors packed into a
flat buffer and unpacked from it, for frameworks whose tensors cannot be views
of a buffer (TensorFlow's). The defaults serve any framework whose tensors
convert to NumPy; ``buffers`` is the adapter the flat buffers belong to.
"""
from __future__ import annotations

import itertools
import math
from typing import Any, Optional, Sequence

import numpy as np

from hvdlite.errors import HvdliteTypeError
from hvdlite.negotiation.requests import dtype_name, to_dtype


class TensorAdapter:
    """Base class; the NumPy adapter below is the reference implementation."""

    framework = "numpy"
    accepted = "numpy.ndarray"          # for messages: what the binding's ops take

    def is_tensor(self, obj: Any) -> bool:
        raise NotImplementedError

    def to_array(self, tensor: Any) -> Any:
        """An array over the tensor's memory (strides kept; no copy where possible)."""
        raise NotImplementedError

    def from_array(self, array: Any) -> Any:
        """A tensor for a result array, sharing its memory where possible."""
        raise NotImplementedError

    def device(self, tensor: Any) -> str:
        """"cpu" or "cuda:N"."""
        return "cpu"

    def cast(self, tensor: Any, dtype: str) -> Any:
        """A copy of ``tensor`` in ``dtype`` ("float16", "bfloat16", or its own dtype's name)."""
        raise NotImplementedError

    def ready_event(self, tensor: Any) -> Any:
        """For a GPU tensor: an event recorded now on the framework's current stream,
        which the engine's stream waits on before reading the tensor (see
        hvdlite.engine.devices). None for host tensors."""
        return None

    def contiguous(self, tensor: Any) -> Any:
        """A contiguous copy of a GPU tensor made on the framework's current stream,
        or None to let the array namespace copy it."""
        return None

    def writable(self, tensor: Any) -> bool:
        """Whether an in-place op may write into the tensor's memory (TensorFlow's
        immutable tensors may not; host arrays also say so by their flags)."""
        return True

    def wait_fence(self, fence: Any) -> None:
        """Make the framework's current stream wait on a result's fence (an event
        the engine recorded after writing it), so no host synchronisation is needed."""

    def inplace_done(self, tensor: Any, result: Any) -> Any:
        """An in-place op on ``tensor`` completed with ``result`` (the array it wrote).
        Frameworks whose arrays are views of tensor memory have nothing to do; one
        whose ``to_array`` gives a copy (TensorFlow variables) stores ``result`` here."""
        return tensor

    def dtype_name(self, tensor: Any) -> str:
        raise NotImplementedError

    def nbytes(self, tensor: Any) -> int:
        return int(self.to_array(tensor).nbytes)

    def is_floating(self, tensor: Any) -> bool:
        raise NotImplementedError

    # -- flat buffers (gradient buckets, see hvdlite.reducer) ------------------------------
    @property
    def buffers(self) -> "TensorAdapter":
        """The adapter of the flat buffers ``flat_buffer`` makes (host NumPy arrays,
        unless the framework's own tensors can be written in place and viewed)."""
        return NUMPY

    def flat_buffer(self, dtype: str, device: str, count: int) -> Any:
        """``count`` zeros of ``dtype`` in one 1-D buffer for tensors on ``device``."""
        return np.zeros(count, to_dtype(dtype))

    def view(self, flat: Any, offset: int, shape: tuple[int, ...]) -> Any:
        """Elements ``offset...`` of ``flat`` as ``shape``, sharing its memory."""
        return flat[offset:offset + math.prod(shape)].reshape(shape)

    def pack(self, tensors: Sequence[Any], flat: Any) -> None:
        """Copy ``tensors`` one after the other into ``flat`` (one copy each)."""
        np.concatenate([np.asarray(self.to_array(t)).reshape(-1) for t in tensors], out=flat)

    def unpack(self, flat: Any, shapes: Sequence[tuple[int, ...]]) -> list[Any]:
        """This framework's tensors of ``shapes``, one after the other in ``flat``."""
        offsets = itertools.accumulate((math.prod(shape) for shape in shapes), initial=0)
        return [self.from_array(self.view(flat, offset, shape))
                for offset, shape in zip(offsets, shapes)]

    def require(self, obj: Any, what: str) -> Any:
        """``obj`` if it is one of this adapter's tensors, else a typed error naming it."""
        if self.is_tensor(obj):
            return obj
        raise HvdliteTypeError(
            f"{what} expects a {self.accepted}; got {_describe(obj)}. Pass a "
            f"{self.accepted} (hvdlite takes NumPy arrays, hvdlite.torch torch tensors, "
            "hvdlite.tensorflow TensorFlow tensors).")


def _describe(obj: Any) -> str:
    kind = type(obj)
    name = kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__name__}"
    text = repr(obj)
    return f"{name} ({text[:40]}...)" if len(text) > 43 else f"{name} ({text})"


class NumpyAdapter(TensorAdapter):
    framework = "numpy"
    accepted = "numpy.ndarray"

    def is_tensor(self, obj: Any) -> bool:
        return isinstance(obj, (np.ndarray, np.generic))

    def to_array(self, tensor: Any) -> np.ndarray:
        return tensor if isinstance(tensor, np.ndarray) else np.asarray(tensor)

    def from_array(self, array: Any) -> Any:
        return array

    def cast(self, tensor: Any, dtype: str) -> Any:
        return tensor.astype(to_dtype(dtype))

    def dtype_name(self, tensor: Any) -> str:
        array = tensor if isinstance(tensor, np.ndarray) else np.asarray(tensor)
        return dtype_name(array.dtype)     # cached: numpy's dtype.name is slow

    def is_floating(self, tensor: Any) -> bool:
        dtype = np.asarray(tensor).dtype
        return dtype.name == "bfloat16" or np.issubdtype(dtype, np.floating)


NUMPY = NumpyAdapter()
_REGISTERED: list[TensorAdapter] = [NUMPY]


def register(adapter: TensorAdapter) -> TensorAdapter:
    """Make ``adapter_for`` find this framework's tensors (compression uses it)."""
    if all(type(a) is not type(adapter) for a in _REGISTERED):
        _REGISTERED.insert(0, adapter)
    return adapter


def adapter_for(tensor: Any) -> Optional[TensorAdapter]:
    return next((a for a in _REGISTERED if a.is_tensor(tensor)), None)
