"""Horovod's Keras callbacks, with Horovod's names, arguments and formulas.

Learning rates are set on the optimizer's learning-rate variable, which the
compiled train step reads at run time. Momentum correction (Goyal et al., as
Horovod: the step after a learning-rate change uses momentum * new_lr / old_lr,
the next ones the momentum again) cannot set ``optimizer.momentum``: Keras 3
keeps it as a Python float, read once when the train step is traced. The
velocity slots are scaled by new_lr / old_lr instead, just before the step:
SGD's ``v = momentum * v - lr * g`` (and RMSprop's) then computes exactly the
corrected update, in a compiled step as in an eager one, on either backend.
Nesterov SGD also adds momentum * v to the variable, so after that step the
variable gets the missing (ratio - 1) * momentum * v.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Union

import keras
import numpy as np

import hvdlite as _hvd
from hvdlite.api.submission import check_count
from hvdlite.keras.variables import average_variables, broadcast_variables


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Make every rank hold ``root_rank``'s model and optimizer state.

    A model that is already built is broadcast when training begins, so the first
    step already starts from the same weights everywhere (and N ranks on 1/N of
    each batch match one process on the whole batch). A model that builds lazily
    (a ``Sequential`` without an ``Input``, a subclassed model) has no variables
    then: Keras creates them, and the optimizer's, inside the first train step.
    Those are broadcast at the end of the first batch, as Horovod does, so every
    rank holds the same weights and optimizer state from the second step on.

    ``local_variables`` (or ``register_local_var``) are left out: each rank keeps
    its own value (Horovod's worker-local variables)."""

    def __init__(self, root_rank: int, device: str = "",
                 local_variables: Any = None) -> None:
        super().__init__()
        self.root_rank = root_rank
        self.broadcast_done = False
        self._local: dict[int, Any] = {}     # id -> variable (kept alive: ids stay unique)
        self._sent: set[int] = set()
        if local_variables is not None:
            single = not isinstance(local_variables, (list, tuple, set))
            for variable in [local_variables] if single else local_variables:
                self.register_local_var(variable)

    def register_local_var(self, var: Any) -> None:
        """Leave ``var`` out of the broadcast: every rank keeps its own value."""
        if not hasattr(var, "assign") or not hasattr(var, "shape"):
            raise _hvd.HvdliteTypeError(
                f"BroadcastGlobalVariablesCallback: a local variable must be a Keras or "
                f"TensorFlow variable; got {type(var).__name__}")
        self._local[id(var)] = var

    def _shared(self, variables: Any) -> list:
        return [v for v in variables if id(v) not in self._local]

    def _unsent(self) -> list:
        """The model's and the (built) optimizer's shared variables not broadcast yet."""
        optimizer = getattr(self.model, "optimizer", None)
        built = optimizer is not None and optimizer.built
        variables = self._shared(self.model.variables) + (
            self._shared(optimizer.variables) if built else [])
        return [v for v in variables if id(v) not in self._sent]

    def _broadcast(self, variables: list) -> None:
        broadcast_variables(variables, self.root_rank)
        self._sent.update(id(v) for v in variables)

    def _build_optimizer_like_the_others(self) -> None:
        """Build this rank's optimizer where another rank's is built already. Horovod's
        resume pattern loads the checkpoint on rank 0 only: its optimizer comes built,
        with its state, while the other ranks' build theirs in the first step. Built
        here (as Keras would, on the model's trainable variables), every rank has the
        same variables to broadcast, and the root's state (iterations, momentum)
        reaches all of them before the first step."""
        optimizer = getattr(self.model, "optimizer", None)
        built = bool(optimizer is not None and optimizer.built)
        if any(_hvd.allgather_object(built, name="BroadcastGlobalVariablesCallback.built")) \
                and not built and optimizer is not None and self.model.trainable_variables:
            optimizer.build(self.model.trainable_variables)

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        if not self.broadcast_done:
            self._build_optimizer_like_the_others()
            self._broadcast(self._unsent())

    def on_train_batch_end(self, batch: int, logs: Optional[dict] = None) -> None:
        if self.broadcast_done:
            return
        self.broadcast_done = True
        if any(id(v) not in self._sent for v in self._shared(self.model.variables)):
            # Built during the first step from each rank's own initial values: the
            # step's update and the optimizer state it made differ too.
            self._broadcast(self._unsent())


class MetricAverageCallback(keras.callbacks.Callback):
    """Replace every numeric entry of the epoch's logs by its mean over ranks.
    Put it before callbacks that read the logs (checkpoints, early stopping)."""

    def __init__(self, device: str = "") -> None:
        super().__init__()

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        if not logs:
            return
        keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0 and
                      np.issubdtype(np.asarray(v).dtype, np.number))
        values = np.array([float(logs[k]) for k in keys], dtype=np.float64)
        averaged = _hvd.allreduce(values, name=f"MetricAverageCallback.{epoch}",
                                  op=_hvd.Average)
        logs.update({k: float(v) for k, v in zip(keys, averaged)})


class PeriodicModelAverageCallback(keras.callbacks.Callback):
    """Local SGD for ``model.fit`` (beyond Horovod): compile with the plain optimizer,
    not ``DistributedOptimizer``, and each rank trains on its own batches; the model's
    trainable weights are averaged across ranks after every batch of the first
    ``warmup_steps``, then after every ``period``-th batch (the first of them included),
    the steps torch's ``PeriodicModelAverager`` averages on. Averaging the weights after
    every batch is synchronous SGD for SGD with or without momentum, whose updates are
    linear in the gradients; an optimizer's own statistics (Adam's moments) stay each
    rank's, in the warm-up as after it. ``step`` counts the batches, across epochs."""

    def __init__(self, period: int, warmup_steps: int = 0,
                 process_set: Optional[Any] = None) -> None:
        super().__init__()
        self.period = check_count(period, "PeriodicModelAverageCallback: period", 1)
        self.warmup_steps = check_count(warmup_steps,
                                        "PeriodicModelAverageCallback: warmup_steps", 0)
        self.process_set = process_set
        self.step = 0
        self._checked: list = []     # the variables the ranks last agreed on

    def on_train_batch_end(self, batch: int, logs: Optional[dict] = None) -> None:
        step, self.step = self.step, self.step + 1
        if step < self.warmup_steps or (step - self.warmup_steps) % self.period == 0:
            average_variables(self.model.trainable_variables, self.process_set, self._checked)


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """Horovod's: a ``ModelCheckpoint`` that keeps the best model only
    (``save_best_only=True``, the whole model), judged by ``monitor``, written by rank 0
    alone (the other ranks hold the same model after each step). Put
    ``MetricAverageCallback`` before it to judge by the mean over ranks.

    ``filepath`` (a ``.keras`` or ``.h5`` path) may be given here, or set on the callback
    before training as Horovod's Spark estimator sets it; training without one is a
    UsageError on every rank."""

    def __init__(self, monitor: str = "val_loss", verbose: int = 0, mode: str = "auto",
                 save_freq: Union[str, int] = "epoch", *,
                 filepath: Optional[str] = None) -> None:
        # Keras checks the path's extension here; one given later is checked by its save.
        super().__init__(filepath=filepath or "unset.keras", monitor=monitor,
                         verbose=verbose, save_best_only=True, save_weights_only=False,
                         mode=mode, save_freq=save_freq)
        self.filepath = filepath

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        if not self.filepath:
            raise _hvd.UsageError("BestModelCheckpoint has no filepath: pass filepath= (a "
                             ".keras or .h5 path) or set callback.filepath before training")
        super().on_train_begin(logs)

    def on_train_batch_end(self, batch: int, logs: Optional[dict] = None) -> None:
        if _hvd.rank() == 0:
            super().on_train_batch_end(batch, logs)

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        if _hvd.rank() == 0:
            super().on_epoch_end(epoch, logs)


def _learning_rate(optimizer: Any) -> float:
    return float(keras.ops.convert_to_numpy(optimizer.learning_rate))


def _iterations(optimizer: Any) -> int:
    return int(keras.ops.convert_to_numpy(optimizer.iterations))


def _momentum_slots(optimizer: Any) -> list:
    """The velocities that Keras 3's momentum optimizers (SGD's ``momentums``,
    RMSprop's ``_momentums``) multiply by ``optimizer.momentum`` each step; none
    for optimizers without a ``momentum`` (Adam's first moments are not one)."""
    momentum = getattr(optimizer, "momentum", None)
    if not isinstance(momentum, (int, float)) or not momentum or not optimizer.built:
        return []
    slots = getattr(optimizer, "momentums", None)
    if slots is None:
        slots = getattr(optimizer, "_momentums", None)
    return [slot for slot in slots or [] if slot is not None]


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """lr = initial_lr * multiplier(epoch) for start_epoch <= epoch < end_epoch;
    at each epoch's start (staircase) or each batch with a fractional epoch
    ``epoch + batch / steps_per_epoch``. ``multiplier`` is a number or a function."""

    def __init__(self, initial_lr: float, multiplier: Union[float, Callable[[float], float]],
                 start_epoch: int = 0, end_epoch: Optional[int] = None,
                 staircase: bool = True, momentum_correction: bool = True,
                 steps_per_epoch: Optional[int] = None) -> None:
        super().__init__()
        self.initial_lr = initial_lr
        self.multiplier = multiplier if callable(multiplier) else (lambda epoch: multiplier)
        self.start_epoch, self.end_epoch = start_epoch, end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = 0
        self._nesterov: Optional[tuple[float, int]] = None   # (ratio, iterations before)

    def _in_range(self, epoch: int) -> bool:
        return epoch >= self.start_epoch and (self.end_epoch is None or epoch < self.end_epoch)

    def _adjust(self, epoch: float) -> None:
        optimizer = self.model.optimizer
        old, new = _learning_rate(optimizer), self.initial_lr * self.multiplier(epoch)
        optimizer.learning_rate = new
        if self.momentum_correction and old > 0 and new != old:
            self._correct_momentum(optimizer, new / old)

    def _correct_momentum(self, optimizer: Any, ratio: float) -> None:
        """Scale the velocities so the next update uses momentum * ratio."""
        slots = _momentum_slots(optimizer)
        for slot in slots:
            slot.assign(keras.ops.multiply(slot.value, ratio))
        if slots and getattr(optimizer, "nesterov", False):
            previous = self._nesterov[0] if self._nesterov else 1.0
            self._nesterov = (previous * ratio, _iterations(optimizer))

    def _steps(self) -> int:
        steps = self.steps_per_epoch or (self.params or {}).get("steps")
        if not steps:
            raise _hvd.UsageError(f"{type(self).__name__} needs steps_per_epoch when Keras "
                                  "does not know the number of steps per epoch")
        return int(steps)

    def on_epoch_begin(self, epoch: int, logs: Optional[dict] = None) -> None:
        self.current_epoch = epoch
        if self.staircase and self._in_range(epoch):
            self._adjust(epoch)

    def _batch_epoch(self, batch: int) -> float:
        """The fractional epoch a batch's rate is computed at: its start."""
        return self.current_epoch + batch / self._steps()

    def on_train_batch_begin(self, batch: int, logs: Optional[dict] = None) -> None:
        if not self.staircase and self._in_range(self.current_epoch):
            self._adjust(self._batch_epoch(batch))

    def on_train_batch_end(self, batch: int, logs: Optional[dict] = None) -> None:
        if self._nesterov is None:
            return
        optimizer, (ratio, before) = self.model.optimizer, self._nesterov
        if _iterations(optimizer) == before:
            return   # no update this batch (backward_passes_per_step): wait for it
        self._nesterov = None
        extra = (ratio - 1.0) * optimizer.momentum
        for variable, slot in zip(optimizer._trainable_variables, _momentum_slots(optimizer)):
            variable.assign_add(keras.ops.multiply(slot.value, extra))

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        if logs is not None:
            logs["lr"] = _learning_rate(self.model.optimizer)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Goyal et al.'s gradual warmup, as Horovod: over ``warmup_epochs`` the rate
    goes from initial_lr / size to initial_lr, following
    lr(epoch) = initial_lr * (epoch * (size - 1) / warmup_epochs + 1) / size,
    set before each batch at the fractional epoch its end reaches,
    ``epoch + (batch + 1) / steps_per_epoch``: the last warm-up batch runs at
    exactly ``initial_lr``, which then stays."""

    def __init__(self, initial_lr: float, warmup_epochs: int = 5,
                 momentum_correction: bool = True, steps_per_epoch: Optional[int] = None,
                 verbose: int = 0) -> None:
        def multiplier(epoch: float) -> float:
            size = _hvd.size()
            # Divided by size last: at epoch == warmup_epochs this is size / size, 1.0.
            return (epoch * (size - 1) / warmup_epochs + 1) / size
        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs,
                         staircase=False, momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch)
        self.warmup_epochs = warmup_epochs
        self.verbose = verbose

    def _batch_epoch(self, batch: int) -> float:
        return self.current_epoch + (batch + 1) / self._steps()

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        super().on_epoch_end(epoch, logs)
        if epoch == self.warmup_epochs - 1 and self.verbose and _hvd.rank() == 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                  f"{_learning_rate(self.model.optimizer):g}.")
