"""Broadcasting Keras variables from a root rank, and averaging them across ranks, on
either backend."""
from __future__ import annotations

from typing import Any, Optional, Sequence

import keras
import numpy as np

import hvdlite as _hvd
from hvdlite.api.process_set import ProcessSet
from hvdlite.api.variable_check import check_same_variables
from hvdlite.keras.backend import BACKEND


def _specs(variables: Sequence[Any]) -> list[tuple[str, tuple, str]]:
    return [(str(getattr(v, "path", None) or f"#{i}"), tuple(v.shape), str(v.dtype))
            for i, v in enumerate(variables)]


def broadcast_variables(variables: Sequence[Any], root_rank: int,
                        process_set: Optional[ProcessSet] = None) -> None:
    """Overwrite every rank's variables (Keras variables, or tf.Variables on the
    TensorFlow backend) with ``root_rank``'s. On the TensorFlow backend this also
    works inside tf.function; on torch it runs eagerly, as Keras does there."""
    variables = list(variables)
    if BACKEND == "tensorflow":
        from hvdlite.tensorflow.functions import broadcast_variables as tf_broadcast
        return tf_broadcast(variables, root_rank, process_set)
    # Op names from the names all ranks agree on (a loaded model's may differ).
    agreed = check_same_variables(_specs(variables), "broadcast_variables", process_set)
    arrays = [np.array(keras.ops.convert_to_numpy(v)) for v in variables]
    handles = [_hvd.broadcast_async_(a, root_rank, name=f"broadcast_variables.{i}.{name}",
                                     process_set=process_set)
               for i, (a, name) in enumerate(zip(arrays, agreed))]
    for variable, array, handle in zip(variables, arrays, handles):
        _hvd.synchronize(handle)
        variable.assign(array)
    return None


def average_variables(variables: Sequence[Any], process_set: Optional[ProcessSet] = None,
                      checked: Optional[list] = None) -> None:
    """Replace every rank's variables by their mean across the ranks, in one grouped
    allreduce, eagerly. The ranks must pass the same variables: checked first, unless
    they are those of ``checked`` (a list this call fills with what it checked)."""
    variables = list(variables)
    specs = _specs(variables)
    if checked is None or checked != specs:
        check_same_variables(specs, "average_variables", process_set)
        if checked is not None:
            checked[:] = specs
    arrays = [np.array(keras.ops.convert_to_numpy(v)) for v in variables]
    if arrays:
        _hvd.grouped_allreduce_(arrays, op=_hvd.Average, name="average_variables",
                                process_set=process_set)
    for variable, array in zip(variables, arrays):
        variable.assign(array)


def broadcast_global_variables(root_rank: int) -> None:
    """Horovod's name for broadcasting TensorFlow 1's global variable collection. Keras 3
    keeps its variables in models and optimizers, with no global collection (Horovod's
    raises in TensorFlow 2's eager mode too): this raises a UsageError naming what to
    call instead."""
    raise _hvd.UsageError(
        f"broadcast_global_variables({root_rank}): Keras 3 keeps no global variables to "
        "broadcast. Call hvd.broadcast_variables(model.variables, root_rank) and "
        "hvd.broadcast_variables(model.optimizer.variables, root_rank) once they are built, "
        "or pass hvd.callbacks.BroadcastGlobalVariablesCallback(root_rank) to model.fit")
