"""Horovod's TensorFlow-only basics: the rank and size as ops, and the TF1
``broadcast_global_variables``.

``size_op``, ``rank_op`` and the others return int32 scalars. Eagerly they are
constants; inside ``tf.function`` each is an op that reads the value when the
graph runs, not when it is traced, as Horovod's are.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import tensorflow as tf

from hvdlite.api import runtime
from hvdlite.errors import UsageError
from hvdlite.tensorflow import graph


def _executing_eagerly() -> bool:
    """Horovod's name for ``tf.executing_eagerly()`` (its scripts and tests call
    ``hvd._executing_eagerly()``)."""
    return tf.executing_eagerly()


def _set_ranks(process_set_id: int, what: str) -> tuple[int, ...]:
    if process_set_id == 0:
        return tuple(range(runtime.size()))
    ranks = runtime.engine(what).registry.ranks_of(process_set_id)
    if ranks is None:
        raise UsageError(f"{what}: no process set with id {process_set_id} is registered on "
                         f"rank {runtime.rank()}; pass the process_set_id of a set added with "
                         "add_process_set (0 is the global set)")
    return ranks


def _scalar_op(value: Callable[[], int], name: Optional[str]) -> tf.Tensor:
    if graph.eager():
        return tf.constant(value(), dtype=tf.int32)
    result = tf.py_function(lambda: tf.constant(value(), dtype=tf.int32), [], Tout=tf.int32,
                            name=name or "HvdliteBasic")
    result.set_shape([])
    return result


def size_op(process_set_id: int = 0, name: Optional[str] = None) -> tf.Tensor:
    """The number of ranks in the process set (default: all of them)."""
    runtime.engine("hvdlite.tensorflow.size_op()")
    return _scalar_op(lambda: len(_set_ranks(process_set_id, "size_op")), name)


def local_size_op(name: Optional[str] = None) -> tf.Tensor:
    """The number of ranks on this machine."""
    runtime.engine("hvdlite.tensorflow.local_size_op()")
    return _scalar_op(runtime.local_size, name)


def rank_op(name: Optional[str] = None) -> tf.Tensor:
    """This process's global rank."""
    runtime.engine("hvdlite.tensorflow.rank_op()")
    return _scalar_op(runtime.rank, name)


def local_rank_op(name: Optional[str] = None) -> tf.Tensor:
    """This process's rank on its machine."""
    runtime.engine("hvdlite.tensorflow.local_rank_op()")
    return _scalar_op(runtime.local_rank, name)


def process_set_included_op(process_set_id: int = 0, name: Optional[str] = None) -> tf.Tensor:
    """1 if this rank belongs to the process set, else 0 (an unknown id is a UsageError)."""
    runtime.engine("hvdlite.tensorflow.process_set_included_op()")
    return _scalar_op(lambda: int(runtime.rank() in _set_ranks(
        process_set_id, "process_set_included_op")), name)


def broadcast_global_variables(root_rank: int) -> Any:
    """TF1's broadcast of ``tf.compat.v1.global_variables()``: the op to run in the
    session after the variables are initialized. TF2 code runs eagerly
    and keeps its variables in models and optimizers, not in a global collection:
    there this raises a UsageError (a RuntimeError, as Horovod's) naming what to call."""
    if graph.eager():
        raise UsageError(
            "broadcast_global_variables() does not work in eager mode: TensorFlow 2 has no "
            "global variable collection. Call hvd.broadcast_variables(model.variables, "
            "root_rank) and hvd.broadcast_variables(optimizer.variables, root_rank), or use "
            "hvdlite.keras.callbacks.BroadcastGlobalVariablesCallback with model.fit")
    from hvdlite.tensorflow.functions import broadcast_variables
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


class BroadcastGlobalVariablesHook(tf.compat.v1.train.SessionRunHook):
    """For ``tf.compat.v1.train.MonitoredTrainingSession``: once the session has
    initialized the variables, overwrite every rank's global variables with
    ``root_rank``'s. ``device`` is accepted for Horovod (the broadcast runs on the host)."""

    def __init__(self, root_rank: int, device: str = "") -> None:
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self._op: Any = None

    def begin(self) -> None:
        # The session's graph is final after begin(): build the op here, once per graph.
        if self._op is None or self._op.graph is not tf.compat.v1.get_default_graph():
            self._op = broadcast_global_variables(self.root_rank)

    def after_create_session(self, session: Any, coord: Any) -> None:
        session.run(self._op)
