"""hvdlite's errors in TensorFlow's vocabulary too.

Horovod's TensorFlow ops fail with TensorFlow's error classes: ranks that
disagree (shape, dtype, root rank, splits) with ``tf.errors.FailedPreconditionError``,
bad arguments with ``tf.errors.InvalidArgumentError``, an op sparse gradients do
not support with ``NotImplementedError``. Scripts catch those. The TensorFlow
binding raises errors that are both: the hvdlite class (``MismatchError``,
``UsageError``...) and the TensorFlow one, so ``except hvd.MismatchError`` and
``except tf.errors.FailedPreconditionError`` both catch the same error.

That holds for every error raised in Python: eager calls, and calls made while
``tf.function`` traces (argument checks). A collective that fails while a traced
function *runs* fails inside a ``tf.py_function``, and TensorFlow's runtime
decides the class the caller sees from the Python error's type alone: usage
errors (ValueErrors) arrive as ``InvalidArgumentError``, ``NotSupportedError`` as
``UnimplementedError``, and the others (a mismatch, a lost peer) as
``UnknownError``; the message always starts with the hvdlite class's name.
"""
from __future__ import annotations

import functools

import tensorflow as tf

from hvdlite.errors import (HvdliteError, HvdliteTypeError, JoinError, MismatchError,
                            NotSupportedError, UsageError)

# First match wins: the most specific classes first.
_TENSORFLOW_CLASS: tuple[tuple[type[HvdliteError], type[tf.errors.OpError]], ...] = (
    (NotSupportedError, tf.errors.UnimplementedError),
    (MismatchError, tf.errors.FailedPreconditionError),
    (JoinError, tf.errors.FailedPreconditionError),
    (UsageError, tf.errors.InvalidArgumentError),
    (HvdliteTypeError, tf.errors.InvalidArgumentError),
)


@functools.lru_cache(maxsize=None)
def _both(hvdlite_class: type[HvdliteError], tf_class: type[tf.errors.OpError]) -> type:
    """``hvdlite_class`` that is also ``tf_class``, under the hvdlite name."""
    return type(hvdlite_class.__name__, (hvdlite_class, tf_class),
                {"__module__": hvdlite_class.__module__,
                 "__qualname__": hvdlite_class.__qualname__,
                 "__str__": lambda self: self.message})


def in_tensorflow_terms(error: HvdliteError) -> HvdliteError:
    """``error`` as an instance of its class and of the TensorFlow error class
    Horovod raises for it; the same error where TensorFlow has no counterpart (a
    collective that failed: elastic training recovers from those by their class)."""
    if isinstance(error, tf.errors.OpError):
        return error
    tf_class = next((tf_cls for hv_cls, tf_cls in _TENSORFLOW_CLASS
                     if isinstance(error, hv_cls)), None)
    if tf_class is None:
        return error
    cls = _both(type(error), tf_class)
    both = cls.__new__(cls)
    both.__dict__.update(error.__dict__)
    tf_class.__init__(both, None, None, str(error))   # TensorFlow's node_def, op, message
    both.args = error.args
    both.__cause__, both.__suppress_context__ = error.__cause__, True
    return both.with_traceback(error.__traceback__)
