"""Momentum correction of hvdlite.keras's learning-rate callbacks inside
model.fit (Keras 3 on TensorFlow: the compiled train step; make test also runs
this file with KERAS_BACKEND=torch): the momentum each SGD update actually
applies, read back from the velocity and the weights, is
momentum * new_lr / old_lr on the step after a change and the momentum again
afterwards (Horovod's formula)."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.mpi.keras_backend import keras

import hvdlite.keras as hvd

MOMENTUM, LR, STEPS, EPOCHS, ROWS = 0.9, 0.5, 3, 4, 2
FEATURES = np.array([1.0, 2.0, -3.0])   # every row: the gradient of mean(x @ w) is this


class _Recorder(keras.callbacks.Callback):
    """Velocity and kernel after each step, once the other callbacks are done
    with it (put it last), and the learning rate the step used. The state
    before a step is the one after the previous step: only the callbacks'
    corrections, which are under test, come in between."""

    def __init__(self) -> None:
        super().__init__()
        self.after: list[tuple[np.ndarray, np.ndarray]] = []
        self.rates: list[float] = []

    def _state(self) -> tuple[np.ndarray, np.ndarray]:
        optimizer = self.model.optimizer
        velocity = (keras.ops.convert_to_numpy(optimizer.momentums[0]) if optimizer.built
                    else np.zeros((3, 1)))
        return velocity.copy(), keras.ops.convert_to_numpy(self.model.layers[0].kernel).copy()

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.after.append(self._state())
        self.rates.append(float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)))


class _MeanOutput(keras.losses.Loss):
    def call(self, y_true: Any, y_pred: Any) -> Any:
        return keras.ops.mean(y_pred, axis=-1)


def _train(nesterov: bool, correction: bool) -> _Recorder:
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.layers.Input((3,), dtype="float64"),
                              keras.layers.Dense(1, use_bias=False, dtype="float64")])
    loss = _MeanOutput(dtype="float64")
    sgd = keras.optimizers.SGD(LR, momentum=MOMENTUM, nesterov=nesterov)
    model.compile(optimizer=hvd.DistributedOptimizer(sgd), loss=loss)
    x = np.tile(FEATURES, (STEPS * ROWS, 1))
    recorder = _Recorder()
    callbacks = [                 hvd.callbacks.LearningRateWarmupCallback(LR, warmup_epochs=2,
                                                          momentum_correction=correction),
                 hvd.callbacks.LearningRateScheduleCallback(LR, 0.25, start_epoch=3,
                                                            momentum_correction=correction),
                 recorder]
    model.fit(x, np.zeros((len(x), 1)), batch_size=ROWS, epochs=EPOCHS, shuffle=False,
              verbose=0, callbacks=callbacks)
    assert not model.run_eagerly        # on TensorFlow, the compiled train step
    assert model.optimizer.momentum == MOMENTUM
    return recorder


def _applied_momentum(recorder: _Recorder, nesterov: bool) -> np.ndarray:
    """Per step from the second: the momentum the update used, from SGD's
    v' = mu v - lr g (and w' = w + mu v' - lr g with Nesterov)."""
    grad = FEATURES[:, None]
    applied = []
    for t in range(1, len(recorder.rates)):
        (v, w), (v_new, w_new), lr = recorder.after[t - 1], recorder.after[t], recorder.rates[t]
        if nesterov:
            applied.append(np.mean((w_new - w + lr * grad) / v_new))
        else:
            applied.append(np.mean((v_new + lr * grad) / v))
    return np.array(applied)


@pytest.mark.parametrize("nesterov", [False, True])
def test_momentum_correction_applies_horovods_formula_in_the_compiled_step(
        nesterov: bool) -> None:
    recorder = _train(nesterov, correction=True)
    rates = np.array(recorder.rates)
    ratios = rates[1:] / rates[:-1]
    assert np.sum(ratios != 1.0) >= 1 and np.sum(ratios == 1.0) >= 2   # changes, then none
    np.testing.assert_allclose(_applied_momentum(recorder, nesterov), MOMENTUM * ratios,
                               rtol=1e-6)   # float32 learning rates


def test_without_correction_the_momentum_stays() -> None:
    recorder = _train(nesterov=False, correction=False)
    np.testing.assert_allclose(_applied_momentum(recorder, False), MOMENTUM, rtol=1e-6)
