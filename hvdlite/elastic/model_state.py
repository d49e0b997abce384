"""Elastic state of variables: a Keras model, its optimizer, a list of variables.

Framework-neutral by duck typing (no framework is imported here): a variable
is anything with ``numpy()`` (or ``__array__``) and ``assign``, which covers
``tf.Variable`` and Keras 3 variables on every backend. The binding supplies
the ``broadcast_variables`` that ``sync()`` uses. A commit captures every
variable as a NumPy copy, so a restore assigns the very bits that were
committed: model weights, non-trainable state (batch-norm statistics, the
dropout seed) and every optimizer slot, including its iteration counter.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from hvdlite.elastic.state import Handler, ObjectState
from hvdlite.errors import StateError, UsageError

BroadcastVariables = Callable[..., Any]


def variables_of(owner: Any) -> list[Any]:
    """``owner.variables`` (a list in Keras 3, a method in older Keras and tf.Module
    subclasses that define it so), or ``owner`` itself when it is a list."""
    if isinstance(owner, (list, tuple)):
        return list(owner)
    found = owner.variables
    return list(found() if callable(found) else found)


def _label(variable: Any, index: int) -> str:
    return str(getattr(variable, "path", None) or getattr(variable, "name", None) or f"#{index}")


def _to_numpy(variable: Any) -> np.ndarray:
    value = variable.numpy() if hasattr(variable, "numpy") else variable
    return np.array(value, copy=True)


class VariablesHandler(Handler):
    """An object whose state is its variables (a model, an optimizer, a list):
    captured as NumPy copies, assigned back in place, broadcast from rank 0."""

    def __init__(self, value: Any, name: str, broadcast: BroadcastVariables) -> None:
        super().__init__(value)
        self.name = name
        self.broadcast = broadcast

    def capture(self) -> list[np.ndarray]:
        return [_to_numpy(v) for v in variables_of(self.value)]

    def apply(self, captured: Sequence[np.ndarray]) -> Any:
        variables = variables_of(self.value)
        self._check(variables, captured)
        for variable, array in zip(variables, captured):
            variable.assign(array)
        return self.value

    def sync(self, broadcast_object: Callable[[Any], Any]) -> Any:
        variables = variables_of(self.value)
        if variables:
            self.broadcast(variables, root_rank=0)
        return self.value

    def _check(self, variables: list[Any], captured: Sequence[np.ndarray]) -> None:
        """A committed file from another model must not be half-assigned."""
        if len(variables) != len(captured):
            raise StateError(f"elastic state attribute {self.name!r}: the commit holds "
                             f"{len(captured)} variables, this one has {len(variables)}; use "
                             "a new HVDLITE_ELASTIC_DIR to start over")
        for index, (variable, array) in enumerate(zip(variables, captured)):
            shape = tuple(int(d) for d in variable.shape)
            dtype = _dtype_name(variable.dtype)
            if tuple(array.shape) != shape or array.dtype.name != dtype:
                raise StateError(
                    f"elastic state attribute {self.name!r}: variable "
                    f"{_label(variable, index)} is {dtype}{list(shape)}, the commit holds "
                    f"{array.dtype.name}{list(array.shape)}; use a new HVDLITE_ELASTIC_DIR "
                    "to start over")


def _dtype_name(dtype: Any) -> str:
    """'float32' for a tf.DType, a Keras dtype string or a torch dtype alike."""
    return str(getattr(dtype, "name", None) or dtype).removeprefix("torch.")


class ModelState(ObjectState):
    """A Keras model and its optimizer (``optimizer`` defaults to the model's
    compiled one), plus plain attributes, saved, restored and synced together.

    The optimizer is built on the model's trainable variables here if it is not
    yet (Keras 3 creates its slots lazily), so its state exists to be committed
    and broadcast before the first step.
    """

    def __init__(self, model: Any, optimizer: Any, broadcast_variables: BroadcastVariables,
                 bcast_object: Callable[..., Any], get_rank: Callable[[], int],
                 **kwargs: Any) -> None:
        if model is None or not hasattr(model, "variables"):
            raise UsageError(f"{type(self).__name__} needs a Keras model, not "
                             f"{type(model).__name__}")
        if not getattr(model, "built", True):
            raise UsageError(f"{type(self).__name__}: the model must be built first (give it "
                             "an Input layer, call model.build(input_shape) or call it once)")
        optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        handlers: dict[str, Handler] = {
            "model": VariablesHandler(model, "model", broadcast_variables)}
        if optimizer is not None:
            _build(optimizer, model)
            handlers["optimizer"] = VariablesHandler(optimizer, "optimizer",
                                                     broadcast_variables)
        else:
            kwargs["optimizer"] = None
        super().__init__(bcast_object=bcast_object, get_rank=get_rank, handlers=handlers,
                         **kwargs)


def _build(optimizer: Any, model: Any) -> None:
    if getattr(optimizer, "built", True) or not hasattr(optimizer, "build"):
        return
    optimizer.build(model.trainable_variables)


class VariablesState(ObjectState):
    """A list of variables (exposed as ``state.variables``) plus plain attributes."""

    def __init__(self, variables: Sequence[Any], broadcast_variables: BroadcastVariables,
                 bcast_object: Callable[..., Any], get_rank: Callable[[], int],
                 **kwargs: Any) -> None:
        handler = VariablesHandler(list(variables), "variables", broadcast_variables)
        super().__init__(bcast_object=bcast_object, get_rank=get_rank,
                         handlers={"variables": handler}, **kwargs)
