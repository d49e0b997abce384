"""``hvd.elastic`` for ``import hvdlite.keras as hvd``: Horovod's Keras elastic API
(``KerasState`` and the commit/update callbacks) over restart-based recovery
(see ``hvdlite.elastic.driver``).

Put the callbacks in this order, so a commit sees the epoch and batch of the
step it follows::

    callbacks = [hvd.elastic.UpdateEpochStateCallback(state),
                 hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.CommitStateCallback(state, batches_per_commit=10)]

One difference from Horovod, for an exact resume: ``state.batch`` is the number
of batches of the current epoch done (Horovod stores the index of the last
one, one less), so ``x[state.batch * batch_size:]`` is what is left of the
epoch. Keras 3 does not let a callback shorten an epoch (Horovod lowered
``params['steps']``, which Keras 3 only shows in the progress bar), so a
script that resumes mid-epoch feeds the rest of the epoch itself (see the
README); one that resumes at epoch boundaries needs nothing more.
"""
from __future__ import annotations

from typing import Any, Optional

import keras

import hvdlite as _hvd
from hvdlite.api.runtime import rank
from hvdlite.api.submission import check_count
from hvdlite.elastic import (HorovodInternalError, HostsUpdatedInterrupt, ObjectState, State,
                             run_fn)
from hvdlite.elastic.model_state import ModelState
from hvdlite.errors import UsageError
from hvdlite.keras.backend import BACKEND
from hvdlite.keras.variables import broadcast_variables

if BACKEND == "tensorflow":
    # Horovod's KerasState is a TensorFlowKerasState; so is this one on TensorFlow,
    # and run translates collective failures raised inside the compiled train step.
    from hvdlite.tensorflow.elastic import TensorFlowKerasState as _StateBase
    from hvdlite.tensorflow.elastic import run
else:
    from hvdlite.elastic import run
    _StateBase = ModelState


class KerasState(_StateBase):  # type: ignore[valid-type,misc]
    """Horovod's ``KerasState(model, optimizer=None, **kwargs)``: the model's
    variables, the optimizer's (the model's compiled optimizer by default; built
    here if Keras has not built it yet), and plain attributes such as
    ``epoch=0, batch=0``, committed and restored bitwise."""

    def __init__(self, model: Any, optimizer: Any = None, **kwargs: Any) -> None:
        ModelState.__init__(self, model, optimizer, broadcast_variables=broadcast_variables,
                            bcast_object=_hvd.broadcast_object, get_rank=rank, **kwargs)


def _require(state: Any, attribute: str, callback: str) -> None:
    if not isinstance(state, State):
        raise UsageError(f"{callback} needs an elastic State (e.g. hvd.elastic.KerasState), "
                         f"not {type(state).__name__}")
    if not hasattr(state, attribute):
        raise UsageError(f"{callback} keeps state.{attribute} up to date: create the state "
                         f"with {attribute}=0 (e.g. KerasState(model, epoch=0, batch=0))")


class CommitStateCallback(keras.callbacks.Callback):
    """Commit ``state`` after every ``batches_per_commit`` training batches and at
    the end of every epoch. The count starts again when training begins, so all
    ranks commit at the same batches after a reset."""

    def __init__(self, state: State, batches_per_commit: int = 1) -> None:
        super().__init__()
        _require(state, "commit", "CommitStateCallback")
        self.state = state
        self.batches_per_commit = check_count(batches_per_commit,
                                              "CommitStateCallback: batches_per_commit", 1)
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        self.batches_remaining = self.batches_per_commit

    def on_train_batch_end(self, batch: int, logs: Optional[dict] = None) -> None:
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keep ``state.batch`` at the number of batches of the current epoch done,
    counted from the batch where this fit began (a fit that resumes an epoch
    starts at ``state.batch``); back to 0 at the end of every epoch."""

    def __init__(self, state: State) -> None:
        super().__init__()
        _require(state, "batch", "UpdateBatchStateCallback")
        self.state = state
        self.initial_batch = 0

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        self.initial_batch = int(self.state.batch)

    def on_train_batch_end(self, batch: int, logs: Optional[dict] = None) -> None:
        self.state.batch = self.initial_batch + batch + 1

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        self.state.batch = 0
        self.initial_batch = 0        # the next epoch starts from its first batch


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keep ``state.epoch`` at the number of epochs done over the whole job: at the
    end of each epoch, the value it had when this fit began plus the epochs this
    fit has finished. Works with ``fit(epochs=total - state.epoch)`` (Horovod's
    examples) and with ``fit(initial_epoch=state.epoch, epochs=total)``."""

    def __init__(self, state: State) -> None:
        super().__init__()
        _require(state, "epoch", "UpdateEpochStateCallback")
        self.state = state
        self.initial_epoch = int(state.epoch)
        self._first_epoch: Optional[int] = None

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        self.initial_epoch = int(self.state.epoch)
        self._first_epoch = None

    def on_epoch_begin(self, epoch: int, logs: Optional[dict] = None) -> None:
        if self._first_epoch is None:
            self._first_epoch = epoch     # Keras numbers from fit's initial_epoch

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        first = epoch if self._first_epoch is None else self._first_epoch
        self.state.epoch = self.initial_epoch + (epoch - first) + 1


__all__ = ["KerasState", "CommitStateCallback", "UpdateBatchStateCallback",
           "UpdateEpochStateCallback", "run", "run_fn", "State", "ObjectState",
           "HorovodInternalError", "HostsUpdatedInterrupt"]
