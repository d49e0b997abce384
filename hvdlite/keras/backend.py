"""What differs between the Keras backends hvdlite.keras supports: the tensor
binding whose collectives reduce the gradients, and how a gradient list is
reduced. Any other backend is refused here, at import. ``ADAPTER`` says which
objects are the backend's tensors; ``OPS`` is its binding's op set."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import keras

SUPPORTED = ("tensorflow", "torch")
BACKEND = keras.backend.backend()


class UnsupportedBackendError(ImportError):
    """hvdlite.keras was imported with a Keras backend it does not support."""


if BACKEND not in SUPPORTED:
    raise UnsupportedBackendError(
        f"hvdlite.keras supports the Keras backends {' and '.join(SUPPORTED)}; this Keras "
        f"runs on '{BACKEND}'. Set KERAS_BACKEND=tensorflow or KERAS_BACKEND=torch before "
        "importing keras (for JAX, hvdlite has no binding yet).")

if BACKEND == "tensorflow":
    from hvdlite.tensorflow.adapter import TENSORFLOW as ADAPTER
    from hvdlite.tensorflow.ops import OPS
else:
    from hvdlite.torch.adapter import TORCH as ADAPTER
    from hvdlite.torch.ops import OPS


def make_reducer(what: str, **settings: Any) -> Callable[[Sequence[Any], Sequence[Any]], list]:
    """``reduce(grads, variables) -> averaged grads`` for this backend."""
    if BACKEND == "tensorflow":
        from hvdlite.tensorflow.gradients import GradientAverager
        return GradientAverager(what, **settings)
    from hvdlite.keras.torch_reduce import TorchGradientAverager
    return TorchGradientAverager(what, **settings)


def entry_point(fn: Callable[..., Any]) -> Callable[..., Any]:
    """On TensorFlow, keep AutoGraph out of hvdlite's code and let its errors
    through unchanged (see hvdlite.tensorflow.graph); nothing to do on torch."""
    if BACKEND == "tensorflow":
        from hvdlite.tensorflow.graph import entry_point as tf_entry_point
        return tf_entry_point(fn)
    return fn


def mark_step(after: Sequence[Any]) -> None:
    """HVDLITE_REPORT: a step boundary once ``after`` (the reduced gradients) exist. In
    a traced TensorFlow step the mark is an op that runs every step (a py_function
    is stateful, so tf.function keeps it); eagerly it is a plain call."""
    from hvdlite.api import report
    recorder = report.recorder()
    if recorder is None:
        return
    if BACKEND == "torch":
        recorder.step_done()
        return
    import tensorflow as tf
    if tf.executing_eagerly():
        recorder.step_done()
        return
    with tf.control_dependencies([t for t in after if t is not None]):
        tf.py_function(lambda: recorder.step_done() or 0, [], [tf.int32],
                       name="HvdliteStepMark")
