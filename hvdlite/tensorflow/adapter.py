"""The TensorFlow tensor adapter: eager tensors and variables cross into the core
as NumPy arrays (``.numpy()``), results come back as eager tensors. Tensors on a
GPU cross as CuPy arrays over their own memory through DLPack, with no copy, and
results come back the same way.

TensorFlow does not expose its GPU streams, so GPU tensors cannot be ordered by
events as torch's are: at submission hvdlite waits until TensorFlow's queued GPU
work is done (``tf.test.experimental.sync_devices``), and a result's fence is
waited on by the host before the tensor is handed back.

TensorFlow tensors are immutable and a variable's memory is not ours to write,
so an in-place op (``allreduce_``, ``broadcast_``) on a ``tf.Variable`` (or a
Keras 3 variable) works on a staging copy that ``inplace_done`` assigns back
when the op completes; on an immutable ``tf.Tensor`` it is refused. Symbolic
tensors (inside ``tf.function``) never reach this adapter: the binding runs
graph-mode collectives through ``tf.py_function`` (see ``hvdlite.tensorflow.ops``).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from hvdlite.api.adapter import TensorAdapter, register
from hvdlite.errors import HvdliteTypeError


def is_keras_variable(obj: Any) -> bool:
    """A Keras 3 variable on the TensorFlow backend (not a tf.Variable subclass:
    it wraps one in ``.value``)."""
    return type(obj).__module__.startswith("keras") and \
        isinstance(getattr(obj, "value", None), tf.Variable)


def is_variable(obj: Any) -> bool:
    return isinstance(obj, tf.Variable) or is_keras_variable(obj)


class TensorFlowAdapter(TensorAdapter):
    framework = "tensorflow"
    accepted = "tf.Tensor or tf.Variable"

    def is_tensor(self, obj: Any) -> bool:
        return isinstance(obj, (tf.Tensor, tf.Variable)) or is_keras_variable(obj)

    def to_array(self, tensor: Any) -> Any:
        if isinstance(tensor, tf.Tensor) and not hasattr(tensor, "numpy"):
            raise HvdliteTypeError(
                f"got a symbolic tensor ({tensor.name}); the *_async and in-place forms "
                "run eagerly only. Inside tf.function use the blocking forms "
                "(allreduce, allgather, broadcast...), which hvdlite.tensorflow runs "
                "through tf.py_function.")
        if self.device(tensor) != "cpu":
            return _gpu_array(tensor)
        array = tensor.numpy()
        if not isinstance(array, np.ndarray):   # 0-d values come back as NumPy scalars
            array = np.array(array)
        if not is_variable(tensor):
            # Immutable: an in-place op must not pretend to write into it.
            array.setflags(write=False)
        return array

    def from_array(self, array: Any) -> tf.Tensor:
        if not isinstance(array, np.ndarray) and hasattr(array, "__dlpack__"):
            return tf.experimental.dlpack.from_dlpack(array.__dlpack__())   # CuPy: no copy
        return tf.convert_to_tensor(np.asarray(array))

    def device(self, tensor: Any) -> str:
        """"cuda:N" for a tensor or variable on TensorFlow's GPU:N, else "cpu". An
        int32 tensor "on a GPU" is in host memory (TensorFlow keeps int32 there), so
        it travels as a host array, alike on every rank."""
        name = (tensor.value if is_keras_variable(tensor) else tensor).device or ""
        kind, _, index = name.rpartition("device:")[2].partition(":")
        if kind.upper() != "GPU" or tensor.dtype == tf.int32:
            return "cpu"
        return f"cuda:{index or 0}"

    def writable(self, tensor: Any) -> bool:
        return is_variable(tensor)

    def ready_event(self, tensor: Any) -> None:
        # No stream to record on: wait for TensorFlow's queued GPU work instead.
        tf.test.experimental.sync_devices()
        return None

    def wait_fence(self, fence: Any) -> None:
        fence.synchronize()           # TensorFlow's stream cannot wait on our event

    def inplace_done(self, tensor: Any, result: Any) -> Any:
        tensor.assign(result if isinstance(result, np.ndarray) else self.from_array(result))
        return tensor

    def cast(self, tensor: Any, dtype: str) -> tf.Tensor:
        return tf.cast(tensor, tf.as_dtype(dtype))

    def dtype_name(self, tensor: Any) -> str:
        return tf.as_dtype(tensor.dtype).name

    def nbytes(self, tensor: Any) -> int:
        """From the shape where it is known: ``to_array`` copies the tensor to the host."""
        count = tensor.shape.num_elements()
        if count is None:
            return super().nbytes(tensor)
        return int(count) * tf.as_dtype(tensor.dtype).size

    def is_floating(self, tensor: Any) -> bool:
        return tf.as_dtype(tensor.dtype).is_floating

    def pack(self, tensors: Any, flat: np.ndarray) -> None:
        """Into a host buffer: TensorFlow's tensors cannot be written in place, so
        gradient buckets live in host memory (a GPU tensor's ``numpy()`` copies it)."""
        np.concatenate([t.numpy().reshape(-1) for t in tensors], out=flat)


class _Capsule:
    """Hands CuPy a DLPack capsule made without a stream argument (TensorFlow's
    ``__dlpack__`` refuses one, and CuPy passes its own)."""

    def __init__(self, tensor: Any) -> None:
        self._device = tensor.__dlpack_device__()
        self._capsule = tf.experimental.dlpack.to_dlpack(tensor)

    def __dlpack__(self, **_: Any) -> Any:
        return self._capsule

    def __dlpack_device__(self) -> Any:
        return self._device


def _gpu_array(tensor: Any) -> Any:
    """A CuPy view of a GPU tensor's memory; for a variable, a copy (its memory is
    TensorFlow's to write: ``inplace_done`` assigns results back)."""
    try:
        import cupy
    except ImportError:
        raise HvdliteTypeError("TensorFlow GPU tensors need CuPy: pip install "
                               "'hvdlite[cuda12]' (or [cuda13], matching your CUDA)") from None
    if is_variable(tensor):
        value = (tensor.value if is_keras_variable(tensor) else tensor).read_value()
        return cupy.from_dlpack(_Capsule(value)).copy()
    return cupy.from_dlpack(_Capsule(tensor))


TENSORFLOW = register(TensorFlowAdapter())
