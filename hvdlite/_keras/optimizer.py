"""Horovod's Keras ``DistributedOptimizer`` for Keras 3, and ``load_model``.

Keras 3 optimizers have no ``get_gradients``: every update goes through
``apply(grads, variables)`` (``apply_gradients`` calls it; model.fit's train
step calls one or the other). The wrapper is a subclass of the user's optimizer
class, created per call, whose ``apply`` averages the gradients across ranks
first. It keeps the wrapped class's name and ``get_config``, so it serialises
with the model like the plain optimizer, and ``load_model`` re-wraps it.

``backward_passes_per_step=k`` accumulates k local gradients in optimizer
variables and reduces and applies them on every k-th call (``ops.cond``, so it
also works inside the compiled train step); ``optimizer.iterations`` counts
applied updates, as in Horovod.

Keras' LossScaleOptimizer around it (mixed precision) averages before it checks
the gradients for overflow, so that every rank skips the same steps: see
``loss_scale``, which calls ``_hvdlite_step`` with its own check-then-apply.

Collectives run as ``tf.py_function`` inside the train step, which XLA cannot
compile, so a model compiled with ``jit_compile=True`` (or "auto" resolving to
True, on a GPU) runs its train step without XLA when its optimizer is
distributed; rank 0 says so once.

What differs between Keras backends comes in as ``support``, a module of the
backend's binding with ``make_reducer(what, **settings)`` (the list call that
averages gradients), ``entry_point(fn)`` (how ``apply`` is entered: AutoGraph kept
out on TensorFlow) and ``mark_step(after)`` (HVDLITE_REPORT's step boundary):
``hvdlite.tensorflow.keras_support`` or ``hvdlite.keras.torch_reduce``. So this
module imports neither binding, and both import it (``hvdlite.keras`` and
``hvdlite.tensorflow.DistributedOptimizer``).
"""
from __future__ import annotations

import dataclasses
import logging
from types import ModuleType
from typing import Any, Callable, Optional, Sequence

import keras
from keras.src.trainers.trainer import Trainer
from keras.src.utils import tracking

import hvdlite as _hvd
from hvdlite.api import runtime
from hvdlite.api.adapter import _describe
from hvdlite.api.compression import Compression, Compressor
from hvdlite.api.process_set import ProcessSet
from hvdlite.errors import HvdliteTypeError, NotSupportedError, UsageError
from hvdlite.reducer.settings import Groups, Settings as ReducerSettings
from hvdlite._keras import loss_scale
from hvdlite._keras.layers import local_layer_variables

_log = logging.getLogger("hvdlite")


@dataclasses.dataclass(frozen=True)
class Settings:
    name: Optional[str] = None
    compression: type[Compressor] = Compression.none
    sparse_as_dense: bool = False
    passes: int = 1
    average_aggregated: bool = False
    op: int = _hvd.Average
    predivide: float = 1.0
    groups: Any = None
    process_set: Optional[ProcessSet] = None
    scale_local: bool = True


class _Distributed:
    """Mixed in before the user's optimizer class (see ``distributed_class``)."""
    _hvdlite: Settings = Settings()
    _hvdlite_support: ModuleType     # the Keras backend's binding (see the module doc)

    @tracking.no_automatic_dependency_tracking
    def build(self, variables: Sequence[Any]) -> None:
        if self.built:
            return
        super().build(variables)
        if self._hvdlite.passes > 1:   # local accumulation, in optimizer state
            self._hvdlite_accumulators = [
                self.add_variable_from_reference(v, name="hvdlite_accumulator")
                for v in variables]
            self._hvdlite_passes = self.add_variable(shape=(), dtype="int64",
                                                     initializer="zeros",
                                                     name="hvdlite_passes")

    def _hvdlite_plain_variables(self) -> list[Any]:
        """The wrapped optimizer's own state, without the accumulation's variables."""
        ours = {id(v) for v in self.__dict__.get("_hvdlite_accumulators", ())}
        ours.add(id(self.__dict__.get("_hvdlite_passes")))
        return [v for v in self.variables if id(v) not in ours]

    def save_own_variables(self, store: Any) -> None:
        """Saved as the plain optimizer would be: a model saved while accumulating
        loads with its optimizer state (momentum, moments) into load_model's
        DistributedOptimizer, which accumulates nothing, and into the plain class.
        The accumulators, zero after every applied update, start again from zero."""
        for i, variable in enumerate(self._hvdlite_plain_variables()):
            store[str(i)] = keras.ops.convert_to_numpy(variable)

    def load_own_variables(self, store: Any) -> None:
        plain = self._hvdlite_plain_variables()
        if len(store.keys()) != len(plain):
            super().load_own_variables(store)   # a file with the accumulators, or Keras' warning
            return
        for i, variable in enumerate(plain):
            variable.assign(store[str(i)])

    def _hvdlite_reducer(self) -> Any:
        reducer = self.__dict__.get("_hvdlite_averager")
        if reducer is None:
            s = self._hvdlite
            reducer = self._hvdlite_support.make_reducer(
                s.name or f"Distributed{type(self).__name__}", compression=s.compression,
                sparse_as_dense=s.sparse_as_dense, op=s.op, predivide=s.predivide,
                groups=s.groups, process_set=s.process_set, scale_local=s.scale_local)
            self.__dict__["_hvdlite_averager"] = reducer
        return reducer

    def _hvdlite_reduce(self, grads: Sequence[Any], variables: Sequence[Any]) -> list[Any]:
        return self._hvdlite_reducer()(grads, variables)

    def register_local_var(self, var: Any) -> None:
        """Horovod's worker-local variable: its gradient is not reduced (divided by
        the set size unless scale_local_gradients=False) and ranks may differ in it."""
        if not hasattr(var, "assign") or not hasattr(var, "shape"):
            raise HvdliteTypeError(f"register_local_var takes a Keras or TensorFlow "
                                   f"variable; got {_describe(var)}")
        self._hvdlite_reducer().register_local(var)

    def apply(self, grads: Sequence[Any], trainable_variables: Optional[Sequence[Any]] = None) -> Any:
        grads = list(grads)
        if trainable_variables is None:
            if not self.built:
                raise UsageError("apply(grads) without variables needs a built optimizer; "
                                 "pass the variables or call optimizer.build(variables)")
            variables = list(self._trainable_variables)
        else:
            variables = list(trainable_variables)
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(variables)
        if self.__dict__.get("_hvdlite_averaged"):   # by the LossScaleOptimizer around it
            return super().apply(grads, variables)
        return self._hvdlite_step(grads, variables, super().apply)

    def _hvdlite_step(self, grads: list[Any], variables: list[Any],
                      apply_averaged: Callable[[list[Any], list[Any]], Any]) -> Any:
        """Average ``grads`` (or accumulate them, averaging on every k-th call) and
        give the result to ``apply_averaged(grads, variables)``."""
        self._hvdlite_reducer().agree_trained(variables, self._trainable_variables,
                                              _variable_spec)
        if self._hvdlite.passes == 1:
            reduced = self._hvdlite_reduce(grads, variables)
            self._hvdlite_support.mark_step(reduced)
            return apply_averaged(reduced, variables)
        return self._hvdlite_accumulate(grads, variables, apply_averaged)

    def _hvdlite_accumulate(self, grads: list[Any], variables: list[Any],
                            apply_averaged: Callable[[list[Any], list[Any]], Any]) -> None:
        settings = self._hvdlite
        accumulators = [self._hvdlite_accumulators[self._get_variable_index(v)]
                        for v in variables]
        for accumulator, grad in zip(accumulators, grads):
            if grad is not None:   # IndexedSlices too: assign_add scatters them
                accumulator.assign_add(grad)
        self._hvdlite_passes.assign_add(1)
        # Divide by k (exact in any float type); a Python scale 1/k would be cast to
        # floatx first and round in float32.
        divisor = float(settings.passes) if settings.average_aggregated else 1.0

        def update() -> None:
            total = [keras.ops.divide(a.value, divisor) for a in accumulators]
            reduced = self._hvdlite_reduce(total, variables)
            self._hvdlite_support.mark_step(reduced)
            apply_averaged(reduced, variables)
            for accumulator in accumulators:
                accumulator.assign(keras.ops.zeros_like(accumulator.value))

        due = keras.ops.equal(keras.ops.mod(self._hvdlite_passes.value, settings.passes), 0)
        keras.ops.cond(due, update, lambda: None)


def _variable_spec(variable: Any) -> tuple:
    return (str(variable.path), tuple(variable.shape), str(variable.dtype))


def distributed_class(base: type, settings: Settings, support: ModuleType) -> type:
    """The user's optimizer class with gradient averaging mixed in; same name and
    module, so the saved config names the plain class."""
    return type(base.__name__, (_Distributed, base),
                {"_hvdlite": settings, "_hvdlite_support": support,
                 "apply": support.entry_point(_Distributed.apply),
                 "__module__": base.__module__, "__qualname__": base.__qualname__})


def DistributedOptimizer(optimizer: Any, name: Optional[str] = None,
                         device_dense: str = "", device_sparse: str = "",
                         compression: type[Compressor] = Compression.none,
                         sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0,
                         op: int = _hvd.Average, backward_passes_per_step: int = 1,
                         average_aggregated_gradients: bool = False, num_groups: int = 0,
                         groups: Groups = None,
                         process_set: Optional[ProcessSet] = _hvd.global_process_set,
                         scale_local_gradients: bool = True, *, support: ModuleType) -> Any:
    """A copy of ``optimizer`` (same class and config, fresh state) whose updates
    use gradients averaged across ranks. Horovod's arguments, in its order.

    ``apply`` averages the gradients first, so ``apply_gradients``, custom loops and
    ``model.fit`` all go through it. ``optimizer.register_local_var(variable)`` keeps a
    variable worker-local.

    Args:
        optimizer: a Keras 3 optimizer (anything else raises ``TypeError``).
        name: prefix of the collectives' names.
        device_dense: accepted for Horovod, unused.
        device_sparse: accepted for Horovod, unused.
        compression: ``Compression.none``, ``.fp16`` or ``.bf16`` on the wire.
        sparse_as_dense: reduce ``tf.IndexedSlices`` gradients as dense tensors
            instead of allgathering their rows.
        gradient_predivide_factor: with Average, divide by this before the sum and by
            ``size / factor`` after it.
        op: ``hvd.Average`` (the default) or ``hvd.Sum``.
        backward_passes_per_step: accumulate this many local gradients in optimizer
            variables, then reduce and apply them on every k-th call;
            ``optimizer.iterations`` counts applied updates.
        average_aggregated_gradients: average the accumulated gradients instead of
            summing them.
        num_groups: Horovod's spelling of ``groups=n``.
        groups: a number of groups, or lists of variables, each reduced as one op.
        process_set: the ranks to average over (default: every rank).
        scale_local_gradients: divide the gradients of worker-local variables by the
            set size, so that they take steps of the scale of the shared ones.
        support: the Keras backend's binding (given by ``hvdlite.keras`` and
            ``hvdlite.tensorflow.keras``, not by users).
    """
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise HvdliteTypeError(f"DistributedOptimizer wraps a Keras 3 optimizer "
                               f"(keras.optimizers.Optimizer); got {_describe(optimizer)}")
    if isinstance(optimizer, _Distributed):
        raise UsageError("this optimizer is already a DistributedOptimizer")
    runtime.engine("hvdlite.keras.DistributedOptimizer()")   # NotInitializedError
    ReducerSettings(op=op, predivide=gradient_predivide_factor,   # refuses what it cannot do
                    passes=backward_passes_per_step)
    settings = Settings(name, compression or Compression.none, sparse_as_dense,
                        backward_passes_per_step, average_aggregated_gradients, op,
                        gradient_predivide_factor, groups if groups is not None else
                        (num_groups or None), process_set, scale_local_gradients)
    return distributed_class(type(optimizer), settings, support).from_config(
        optimizer.get_config())


def PartialDistributedOptimizer(optimizer: Any, name: Optional[str] = None,
                                device_dense: str = "", device_sparse: str = "",
                                compression: type[Compressor] = Compression.none,
                                sparse_as_dense: bool = False,
                                gradient_predivide_factor: float = 1.0, op: int = _hvd.Average,
                                backward_passes_per_step: int = 1,
                                average_aggregated_gradients: bool = False,
                                num_groups: int = 0, groups: Groups = None,
                                process_set: Optional[ProcessSet] = _hvd.global_process_set,
                                local_layers: Any = None,
                                scale_local_gradients: bool = True, *,
                                support: ModuleType) -> Any:
    """A DistributedOptimizer whose ``local_layers``' trainable variables stay
    worker-local (see ``register_local_var``)."""
    local = local_layer_variables(local_layers, "PartialDistributedOptimizer")
    wrapped = DistributedOptimizer(optimizer, name, device_dense, device_sparse, compression,
                                   sparse_as_dense, gradient_predivide_factor, op,
                                   backward_passes_per_step, average_aggregated_gradients,
                                   num_groups, groups, process_set, scale_local_gradients,
                                   support=support)
    for variable in local:
        wrapped.register_local_var(variable)
    return wrapped


def _keras_optimizer_classes() -> list[type]:
    skip = (keras.optimizers.Optimizer, keras.optimizers.LossScaleOptimizer)
    return [c for c in vars(keras.optimizers).values()
            if isinstance(c, type) and issubclass(c, keras.optimizers.Optimizer)
            and c not in skip]


def _instantiated_class(cls: type) -> type:
    """The class of what ``cls(...)`` makes. On the torch backend Keras' optimizer
    ``__new__`` swaps its built-in optimizers for torch-specialized subclasses
    (keras.optimizers.SGD makes a torch_sgd.SGD), which it does not do for a subclass
    such as the distributed one: wrapped here, a loaded optimizer has the class of one
    made in the script, and its updates are bitwise those of the other ranks'.
    ``__new__`` alone runs no ``__init__``: nothing is created."""
    return type(cls.__new__(cls))


def load_model(filepath: Any, custom_optimizers: Optional[Sequence[type]] = None,
               custom_objects: Optional[dict[str, Any]] = None,
               compression: type[Compressor] = Compression.none,
               legacy_opts: bool = False, *, support: ModuleType) -> keras.Model:
    """``keras.models.load_model`` (a .keras file or a legacy .h5 one) whose
    optimizer comes back as a DistributedOptimizer (with its saved state), for
    Keras' optimizers and ``custom_optimizers``. ``legacy_opts=True`` (Horovod's,
    for ``keras.optimizers.legacy``, which Keras 3 removed) raises NotSupportedError."""
    if legacy_opts:
        raise NotSupportedError("load_model(legacy_opts=True) loads keras.optimizers.legacy "
                                "optimizers, which Keras 3 does not have; leave it False")
    settings = Settings(compression=compression or Compression.none)
    objects: dict[str, Any] = {}
    for cls in _keras_optimizer_classes():
        wrapped = distributed_class(_instantiated_class(cls), settings, support)
        # A legacy .h5 file names a built-in optimizer by its class name, which
        # Keras' optimizers.deserialize lowercases ('sgd', 'adam') before it looks
        # it up; the .keras format keeps 'SGD'. Horovod's load_model keys them so.
        objects[cls.__name__] = objects[cls.__name__.lower()] = wrapped
    objects.update({cls.__name__: distributed_class(_instantiated_class(cls), settings, support)
                    for cls in custom_optimizers or []})
    objects.update(custom_objects or {})
    return keras.models.load_model(filepath, custom_objects=objects)


# -- XLA: collectives cannot live inside an XLA cluster ---------------------------------------
_plain_jit_compile = Trainer.jit_compile
_warned_xla = []


def _jit_compile(model: Any) -> Any:
    value = _plain_jit_compile.fget(model)
    if value and isinstance(getattr(model, "optimizer", None), _Distributed):
        if not _warned_xla and _hvd.is_initialized() and _hvd.rank() == 0:
            _log.warning("hvdlite.keras: the train step runs without XLA (jit_compile=False) "
                         "because its DistributedOptimizer's collectives cannot be compiled "
                         "by XLA.")
        _warned_xla.append(True)
        return False
    return value


Trainer.jit_compile = property(_jit_compile, _plain_jit_compile.fset)
loss_scale.average_first(_Distributed)
