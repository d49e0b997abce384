"""The TensorFlow tensor adapter: eager tensors and variables cross into the core
as NumPy arrays (``.numpy()``), results come back as eager tensors.

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

    def to_array(self, tensor: Any) -> np.ndarray:
        if isinstance(tensor, tf.Tensor) and not hasattr(tensor, "numpy"):
            raise HvdliteTypeError(
                f"got a symbolic tensor ({tensor.name}); the *_async and in-place forms "
                "run eagerly only. Inside tf.function use the blocking forms "
                "(allreduce, allgather, broadcast...), which hvdlite.tensorflow runs "
                "through tf.py_function.")
        array = tensor.numpy()
        if not isinstance(array, np.ndarray):   # 0-d values come back as NumPy scalars
            array = np.array(array)
        if not is_variable(tensor):
            # Immutable: an in-place op must not pretend to write into it.
            array.setflags(write=False)
        return array

    def from_array(self, array: Any) -> tf.Tensor:
        return tf.convert_to_tensor(np.asarray(array))

    def inplace_done(self, tensor: Any, result: Any) -> Any:
        tensor.assign(result)
        return tensor

    def cast(self, tensor: Any, dtype: str) -> tf.Tensor:
        return tf.cast(tensor, tf.as_dtype(dtype))

    def dtype_name(self, tensor: Any) -> str:
        return tf.as_dtype(tensor.dtype).name

    def is_floating(self, tensor: Any) -> bool:
        return tf.as_dtype(tensor.dtype).is_floating


TENSORFLOW = register(TensorFlowAdapter())
