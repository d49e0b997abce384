"""Start-of-training synchronization of TensorFlow variables, and the check that
every rank trains the same variables (which keeps a model that differs across
ranks from hanging in a collective that some rank never submits)."""
from __future__ import annotations

from typing import Any, Optional, Sequence

import tensorflow as tf

import hvdlite as _hvd
from hvdlite.api.process_set import ProcessSet
from hvdlite.errors import MismatchError
from hvdlite.tensorflow import graph
from hvdlite.tensorflow.adapter import TENSORFLOW
from hvdlite.tensorflow.ops import OPS

Spec = tuple[str, tuple, str]


def variable_name(variable: Any, index: int) -> str:
    """A readable, rank-independent label: Keras' path, else the tf name."""
    name = getattr(variable, "path", None) or getattr(variable, "name", None) or f"#{index}"
    return str(name).removesuffix(":0")


def variable_specs(variables: Sequence[Any]) -> list[Spec]:
    return [(variable_name(v, i), tuple(tf.TensorShape(v.shape).as_list()),
             tf.as_dtype(v.dtype).name) for i, v in enumerate(variables)]


def _describe(specs_by_rank: list[list[Spec]]) -> Optional[str]:
    """What differs between the ranks' variable lists, or None."""
    counts = [len(s) for s in specs_by_rank]
    for index in range(max(counts)):
        seen: dict[Any, list[int]] = {}
        for rank, specs in enumerate(specs_by_rank):
            seen.setdefault(specs[index] if index < len(specs) else None, []).append(rank)
        if len(seen) > 1:
            parts = "; ".join(
                f"ranks {ranks} have " + ("no such variable" if spec is None else
                                          f"'{spec[0]}' shape={spec[1]} dtype={spec[2]}")
                for spec, ranks in seen.items())
            return f"variable #{index} differs: {parts}"
    if len(set(counts)) > 1:
        return f"variable counts differ: {counts} (by rank)"
    return None


def check_same_variables(variables: Sequence[Any], what: str,
                         process_set: Optional[ProcessSet] = None) -> None:
    """Raise MismatchError on every rank if the ranks' variables differ in count,
    shape or dtype (an eager exchange: at trace time inside tf.function)."""
    specs = variable_specs(variables)
    every = _hvd.allgather_object(specs, name=f"{what}.variable_check", process_set=process_set)
    problem = _describe(every)
    if problem:
        raise MismatchError(f"rank {_hvd.rank()}: {what}: the ranks' variables differ, so "
                            f"they cannot be trained together: {problem}. Build the same "
                            "model on every rank.")


@graph.entry_point
def broadcast_variables(variables: Sequence[Any], root_rank: int,
                        process_set: Optional[ProcessSet] = None) -> None:
    """Overwrite every rank's variables with ``root_rank``'s (tf.Variables or Keras
    variables), eagerly or inside tf.function (e.g. on the first training step)."""
    variables = list(variables)
    for variable in variables:
        TENSORFLOW.require(variable, "broadcast_variables")
    check_same_variables(variables, "broadcast_variables", process_set)
    names = [f"broadcast_variables.{i}.{variable_name(v, i)}" for i, v in enumerate(variables)]
    if graph.eager():
        handles = [OPS["broadcast_async_"](v, root_rank, name=n, process_set=process_set)
                   for v, n in zip(variables, names)]
        for handle in handles:
            OPS["synchronize"](handle)     # assigns the root's value (adapter.inplace_done)
        return
    for variable, name in zip(variables, names):
        variable.assign(OPS["broadcast"](variable, root_rank, name=name,
                                         process_set=process_set))


def broadcast_object(obj: Any, root_rank: int = 0, session: Any = None,
                     name: Optional[str] = None,
                     process_set: Optional[ProcessSet] = None) -> Any:
    """``root_rank``'s ``obj`` on every rank (``session`` accepted for Horovod)."""
    return _hvd.broadcast_object(obj, root_rank, name, process_set)


def allgather_object(obj: Any, session: Any = None, name: Optional[str] = None,
                     process_set: Optional[ProcessSet] = None) -> list[Any]:
    """Every rank's ``obj`` in rank order (``session`` accepted for Horovod)."""
    return _hvd.allgather_object(obj, name, process_set)
