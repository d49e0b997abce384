"""Local SGD in model.fit (hvdlite.keras.callbacks.PeriodicModelAverageCallback), on
either Keras backend: N ranks on their own shards, the weights averaged on the
callback's steps, reach N replicas trained in one process with the same averaging
(float64, within 1e-10); averaged every batch, SGD with momentum is synchronous SGD on
the whole batch (within 1e-10 on TensorFlow, 1e-6 on torch). After an averaging batch
every rank holds bitwise the same weights."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.mpi.conftest import assert_identical_everywhere
from tests.mpi.keras_backend import keras

import hvdlite.keras as hvd  # noqa: E402

PER_RANK, STEPS, TOLERANCE = 4, 6, 1e-10
# Against one process on the whole batch: Keras's torch backend rounds float64 gradients
# of different batch splits apart by float32-sized amounts (tests/mpi/test_keras_torch.py).
WHOLE_BATCH_TOLERANCE = TOLERANCE if keras.backend.backend() == "tensorflow" else 1e-6


def _model() -> "keras.Model":
    keras.utils.set_random_seed(99)
    return keras.Sequential([keras.layers.Input((5,), dtype="float64"),
                             keras.layers.Dense(6, activation="tanh", dtype="float64"),
                             keras.layers.Dense(2, dtype="float64")])


def _compiled(model: "keras.Model") -> "keras.Model":
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                  loss=keras.losses.MeanSquaredError(dtype="float64"))
    return model


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    rows = STEPS * PER_RANK * hvd.size()
    return rng.normal(size=(rows, 5)), rng.normal(size=(rows, 2))


def _shard(array: np.ndarray, rank: int) -> np.ndarray:
    blocks = array.reshape(STEPS, hvd.size(), PER_RANK, array.shape[-1])
    return blocks[:, rank].reshape(-1, array.shape[-1])


def _fit(period: int, warmup: int) -> tuple["keras.Model", Any]:
    model = _compiled(_model())
    callback = hvd.callbacks.PeriodicModelAverageCallback(period, warmup_steps=warmup)
    x, y = _data()
    model.fit(_shard(x, hvd.rank()), _shard(y, hvd.rank()), batch_size=PER_RANK, epochs=1,
              shuffle=False, verbose=0, callbacks=[callback])
    return model, callback


def _replicas(period: int, warmup: int) -> list[np.ndarray]:
    """hvd.size() models in this process, each on its shard, averaged on the same steps."""
    models = [_compiled(_model()) for _ in range(hvd.size())]
    x, y = _data()
    for step in range(STEPS):
        rows = slice(step * PER_RANK, (step + 1) * PER_RANK)
        for rank, model in enumerate(models):
            # fit, as the ranks train (train_on_batch's weights differed from fit's by 1e-8)
            model.fit(_shard(x, rank)[rows], _shard(y, rank)[rows], batch_size=PER_RANK,
                      epochs=1, shuffle=False, verbose=0)
        if step < warmup or (step - warmup) % period == 0:
            weights = [np.mean(ws, axis=0) for ws in zip(*(m.get_weights() for m in models))]
            for model in models:
                model.set_weights(weights)
    return models[hvd.rank()].get_weights()


@pytest.mark.parametrize("period,warmup", [(2, 1), (3, 0), (1, STEPS)])
def test_fit_with_the_callback_reaches_replicas_averaged_on_the_same_steps(
        period: int, warmup: int) -> None:
    model, callback = _fit(period, warmup)
    assert callback.step == STEPS
    for got, want in zip(model.get_weights(), _replicas(period, warmup)):
        np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE)
    if (STEPS - 1 - warmup) % period == 0 or STEPS - 1 < warmup:   # the last batch averaged
        assert_identical_everywhere(model.get_weights())


def test_averaged_every_batch_sgd_with_momentum_is_synchronous_sgd_on_the_whole_batch() -> None:
    model, _ = _fit(1, 0)
    whole = _compiled(_model())
    x, y = _data()
    whole.fit(x, y, batch_size=PER_RANK * hvd.size(), epochs=1, shuffle=False, verbose=0)
    for got, want in zip(model.get_weights(), whole.get_weights()):
        np.testing.assert_allclose(got, want, rtol=0, atol=WHOLE_BATCH_TOLERANCE)


@pytest.mark.parametrize("period,warmup", [(0, 0), (1, -1), (1.5, 0), (False, 0)])
def test_a_bad_period_or_warm_up_is_refused(period: Any, warmup: Any) -> None:
    with pytest.raises(hvd.UsageError, match="must be an int of at least"):
        hvd.callbacks.PeriodicModelAverageCallback(period, warmup_steps=warmup)


def test_ranks_whose_models_differ_all_get_an_error() -> None:
    if hvd.size() == 1:
        pytest.skip("one rank agrees with itself")
    model = _model()
    variables = model.trainable_variables
    mine = variables if hvd.rank() == 0 else variables[:-1]
    with pytest.raises(hvd.MismatchError, match="average_variables"):
        from hvdlite.keras.variables import average_variables
        average_variables(mine)
