"""The list call: ``averager(gradients, variables) -> gradients``, for frameworks that
hand every gradient over at once (a TensorFlow tape; a Keras optimizer's ``apply``,
on the TensorFlow and the torch backend).

Each distinct list of variables gets a ``Reducer`` of its own (its buckets, agreed
once). Worker-local variables (Horovod's ``register_local_source`` and
``register_local_var``) are left out of the reduction and of the check that the
ranks train the same variables (a model-parallel shard may differ in shape between
ranks); their gradients are divided by the set size unless ``scale_local`` is off,
as Horovod's are. A rank outside the process set keeps its own gradients. What is
the framework's own (missing and sparse gradients, graphs) is the subclass's; a
missing gradient (None) that no rank has comes back None, so the optimizer skips
its variable as in one process (see ``Reducer.unused`` and ``Reducer.never``).
"""
from __future__ import annotations

from typing import Any, Callable, Hashable, Optional, Sequence

from hvdlite.api.adapter import TensorAdapter
from hvdlite.api.variable_check import check_same_variables
from hvdlite.diagnostics import autotune
from hvdlite.errors import UsageError
from hvdlite.reducer.buckets import Reducer, Spec
from hvdlite.reducer.settings import Settings


class GradientLists:
    """One averager (a DistributedGradientTape, a Keras DistributedOptimizer)."""

    def __init__(self, adapter: TensorAdapter, settings: Settings,
                 scale_local: bool = True) -> None:
        self.adapter, self.settings, self.scale_local = adapter, settings, scale_local
        # By id; the dict keeps the variables alive, so their ids stay unique.
        self.local: dict[int, Any] = {}
        self._reducers: dict[Hashable, Reducer] = {}
        self._trained_agreed: set[Hashable] = set()
        # HVDLITE_AUTOTUNE may try other bucket sizes: each change (on every rank, at the
        # same step boundary) lays the buckets out again at the next call.
        autotune.follow("bucket_bytes", self._bucket_bytes_changed)

    def _bucket_bytes_changed(self, bucket_bytes: int) -> None:
        self._reducers.clear()

    @property
    def groups(self) -> Any:
        return self.settings.groups

    def register_local(self, variable: Any) -> None:
        self.local[id(variable)] = variable

    def __call__(self, grads: Sequence[Any], variables: Sequence[Any]) -> list[Any]:
        grads = list(grads)
        if len(grads) != len(variables):
            raise UsageError(f"{self.settings.what}: {len(grads)} gradients for "
                             f"{len(variables)} variables")
        if self.settings.outside():
            return grads
        shared = [i for i, v in enumerate(variables) if id(v) not in self.local]
        reduced = self.reduce_shared([grads[i] for i in shared], [variables[i] for i in shared])
        for i, value in zip(shared, reduced):
            grads[i] = value
        scale = 1.0 / self.settings.set_size() if self.scale_local else 1.0
        for i in sorted(set(range(len(grads))) - set(shared)):
            if grads[i] is not None and scale != 1.0:
                grads[i] = self.scaled(grads[i], scale)
        return grads

    def agree_trained(self, variables: Sequence[Any], known: Sequence[Any],
                      spec: Callable[[Any], tuple]) -> None:
        """Make sure every rank trains the same ones of ``known`` (an optimizer's
        variables): ``variables`` are those this call trains. Two layers of one shape
        frozen on different ranks give lists that the reducer's layout cannot tell
        apart, and their gradients would be averaged together. Once per distinct list,
        on every rank alike (the list changes when a layer freezes or unfreezes);
        ``spec(variable)`` is its (name, shape, dtype)."""
        if self.settings.outside() or self.settings.alone():
            return
        trained = {id(v) for v in variables}
        key = tuple(sorted(trained))
        if key in self._trained_agreed:
            return
        listed = [v for v in known if id(v) not in self.local]
        listed_ids = {id(v) for v in listed}
        listed += [v for v in variables if id(v) not in listed_ids and id(v) not in self.local]
        check_same_variables([(*spec(v), id(v) in trained) for v in listed],
                             self.settings.what, self.settings.process_set,
                             f"{self.settings.what}.trained")
        self._trained_agreed.add(key)

    def reduce_shared(self, grads: list[Any], variables: list[Any]) -> list[Any]:
        """The shared variables' gradients, averaged (the framework's part)."""
        raise NotImplementedError

    def scaled(self, grad: Any, scale: float) -> Any:
        """A worker-local gradient times ``scale`` (Horovod's scale_local_gradients, so
        a local and a shared variable of the same loss take steps of the same size)."""
        return grad * scale

    def reducer(self, specs: Sequence[Spec], variables: Sequence[Any],
                present: Optional[Sequence[bool]] = None) -> Reducer:
        """The reducer of this list of variables (made, and agreed, on first use).
        ``present``: which gradients exist in every call (a traced graph's)."""
        key = (tuple(specs), None if present is None else tuple(present))
        reducer = self._reducers.get(key)
        if reducer is None:
            position = {id(v): i for i, v in enumerate(variables)}
            reducer = self._reducers[key] = Reducer(self.adapter, specs, self.settings,
                                                    lambda v: position.get(id(v)),
                                                    present=present)
        return reducer
