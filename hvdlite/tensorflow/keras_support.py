"""The TensorFlow binding's support for the Keras optimizer hvdlite.keras and
hvdlite.tensorflow share (``hvdlite._keras.optimizer``): its gradients are averaged
by ``GradientAverager``; ``apply`` is entered as the binding's public functions are
(AutoGraph kept out, hvdlite's errors in TensorFlow's terms, no XLA); and
HVDLITE_REPORT's step boundary is an op of the traced step."""
from __future__ import annotations

from typing import Any, Sequence

import tensorflow as tf

from hvdlite.diagnostics import report
from hvdlite.tensorflow.gradients import GradientAverager as make_reducer
from hvdlite.tensorflow.graph import entry_point

__all__ = ["entry_point", "make_reducer", "mark_step"]


def mark_step(after: Sequence[Any]) -> None:
    """A step boundary once ``after`` (the reduced gradients) exist. In a traced step
    the mark is an op that runs every step (a py_function is stateful, so tf.function
    keeps it); eagerly it is a plain call."""
    recorder = report.recorder()
    if recorder is None:
        return
    if tf.executing_eagerly():
        recorder.step_done()
        return
    with tf.control_dependencies([t for t in after if t is not None]):
        tf.py_function(lambda: recorder.step_done() or 0, [], [tf.int32],
                       name="HvdliteStepMark")
