"""Start-of-training synchronization of TensorFlow variables, and the check that
every rank trains the same variables (which keeps a model that differs across
ranks from hanging in a collective that some rank never submits)."""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import tensorflow as tf

import hvdlite as _hvd
from hvdlite.api.process_set import ProcessSet
from hvdlite.api import variable_check
from hvdlite.tensorflow import graph
from hvdlite.tensorflow.adapter import TENSORFLOW
from hvdlite.tensorflow.ops import OPS, assigned


def variable_name(variable: Any, index: int) -> str:
    """A readable, rank-independent label: Keras' path, else the tf name."""
    name = getattr(variable, "path", None) or getattr(variable, "name", None) or f"#{index}"
    return str(name).removesuffix(":0")


def variable_specs(variables: Sequence[Any]) -> list[variable_check.Spec]:
    return [(variable_name(v, i), tuple(tf.TensorShape(v.shape).as_list()),
             tf.as_dtype(v.dtype).name) for i, v in enumerate(variables)]


def check_same_variables(variables: Sequence[Any], what: str,
                         process_set: Optional[ProcessSet] = None) -> list[str]:
    """MismatchError on every rank if the ranks' variables differ in count, shape
    or dtype (an eager exchange: at trace time inside tf.function). Returns the
    names every rank uses for them (the set's first rank's)."""
    return variable_check.check_same_variables(variable_specs(variables), what, process_set)


@graph.entry_point
def broadcast_variables(variables: Sequence[Any], root_rank: int,
                        process_set: Optional[ProcessSet] = None) -> Optional[tf.Operation]:
    """Overwrite every rank's variables with ``root_rank``'s (tf.Variables or Keras
    variables), eagerly or inside tf.function (e.g. on the first training step). In a
    TF1 graph, returns the op that does it, to run in the session (as Horovod's)."""
    variables = list(variables)
    for variable in variables:
        TENSORFLOW.require(variable, "broadcast_variables")
    # Op names from the names all ranks agree on: a model loaded from a file on one
    # rank names its variables differently from the same model built on another.
    agreed = check_same_variables(variables, "broadcast_variables", process_set)
    names = [f"broadcast_variables.{i}.{name}" for i, name in enumerate(agreed)]
    if graph.eager():
        handles = [OPS["broadcast_async_"](v, root_rank, name=n, process_set=process_set)
                   for v, n in zip(variables, names)]
        for handle in handles:
            OPS["synchronize"](handle)     # assigns the root's value (adapter.inplace_done)
        return
    values = [OPS["broadcast"](v, root_rank, name=n, process_set=process_set)
              for v, n in zip(variables, names)]
    return tf.group(*assigned(variables, values))


def broadcast_object(obj: Any, root_rank: int = 0, session: Any = None,
                     name: Optional[str] = None,
                     process_set: Optional[ProcessSet] = None) -> Any:
    """``root_rank``'s ``obj`` on every rank (``session`` accepted for Horovod)."""
    return _hvd.broadcast_object(obj, root_rank, name, process_set)


def allgather_object(obj: Any, session: Any = None, name: Optional[str] = None,
                     process_set: Optional[ProcessSet] = None) -> list[Any]:
    """Every rank's ``obj`` in rank order (``session`` accepted for Horovod)."""
    return _hvd.allgather_object(obj, name, process_set)


def broadcast_object_fn(root_rank: int = 0, session: Any = None, name: Optional[str] = None,
                        process_set: Optional[ProcessSet] = None) -> Callable[[Any], Any]:
    """Horovod's factory for a TF1 session: a function that, called with an object on
    every rank, returns ``root_rank``'s on every rank (as ``broadcast_object``; each call
    is a collective). ``session`` is accepted for Horovod: nothing runs in a graph."""
    def broadcast(obj: Any) -> Any:
        return _hvd.broadcast_object(obj, root_rank, name, process_set)
    return broadcast
