"""``hvd.elastic`` for ``import hvdlite.tensorflow as hvd``: Horovod's TensorFlow 2
elastic API over restart-based recovery (see ``hvdlite.elastic.driver``).

``TensorFlowKerasState(model, optimizer=None, **kwargs)`` commits a Keras model
and optimizer used in a custom loop (``DistributedGradientTape``),
``TensorFlowState(variables, **kwargs)`` a list of ``tf.Variable``s. ``run`` is
the common decorator, plus Horovod's translation of a collective that failed
inside a graph: TensorFlow reports it as an ``UnknownError`` carrying the
hvdlite error's text, which becomes that ``CollectiveFailedError`` again, so the
decorator recovers from it as from an eager one.
"""
from __future__ import annotations

import functools
import re
from typing import Any, Callable, Optional, Sequence, TypeVar

import tensorflow as tf

from hvdlite.api.runtime import rank
from hvdlite.elastic import (HorovodInternalError, HostsUpdatedInterrupt, ObjectState, State,
                             run_fn)
from hvdlite.elastic.model_state import ModelState, VariablesState
from hvdlite.errors import CollectiveFailedError
from hvdlite.tensorflow.functions import broadcast_object, broadcast_variables

F = TypeVar("F", bound=Callable[..., Any])
_ERROR_LINE = re.compile(r"^(\w+): (.*)$", re.MULTILINE)


def _failure_classes() -> dict[str, type[CollectiveFailedError]]:
    found: dict[str, type[CollectiveFailedError]] = {}
    pending: list[type[CollectiveFailedError]] = [CollectiveFailedError]
    while pending:
        cls = pending.pop()
        found[cls.__name__] = cls
        pending.extend(cls.__subclasses__())
    return found


def collective_failure(error: tf.errors.OpError) -> Optional[CollectiveFailedError]:
    """The hvdlite collective failure a TensorFlow op error reports, if it is one
    (a ``tf.py_function`` collective that raised inside a graph)."""
    classes = _failure_classes()
    for match in _ERROR_LINE.finditer(error.message or ""):
        cls = classes.get(match.group(1))
        if cls is not None:
            return cls(match.group(2))
    return None


def _no_reset() -> None:
    """hvdlite keeps its world across a reset (a changed world is a restart)."""


def run(func: F) -> F:
    """Horovod's ``hvd.elastic.run`` decorator (see the module doc)."""

    @functools.wraps(func)
    def translated(state: State, *args: Any, **kwargs: Any) -> Any:
        try:
            return func(state, *args, **kwargs)
        except tf.errors.OpError as exc:
            failure = collective_failure(exc)
            if failure is None:
                raise
            raise failure from exc

    return run_fn(translated, _no_reset)  # type: ignore[return-value]


class TensorFlowKerasState(ModelState):
    """Horovod's ``TensorFlowKerasState(model, optimizer=None, backend=None, **kwargs)``:
    the model's variables and the optimizer's (the model's compiled optimizer by
    default), plus plain attributes. ``backend`` (TF1 sessions) is accepted and
    ignored."""

    def __init__(self, model: Any, optimizer: Any = None, backend: Any = None,
                 **kwargs: Any) -> None:
        super().__init__(model, optimizer, broadcast_variables=broadcast_variables,
                         bcast_object=broadcast_object, get_rank=rank, **kwargs)


class TensorFlowState(VariablesState):
    """Horovod's ``TensorFlowState(variables, session=None, **kwargs)`` for TF2: a
    list of ``tf.Variable``s (``state.variables``). ``session`` is ignored."""

    def __init__(self, variables: Sequence[Any], session: Any = None, **kwargs: Any) -> None:
        super().__init__(variables, broadcast_variables=broadcast_variables,
                         bcast_object=broadcast_object, get_rank=rank, **kwargs)


__all__ = ["TensorFlowKerasState", "TensorFlowState", "run", "run_fn", "State", "ObjectState",
           "HorovodInternalError", "HostsUpdatedInterrupt", "collective_failure"]
