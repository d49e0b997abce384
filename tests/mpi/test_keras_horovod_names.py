"""Horovod's Keras names that scripts use besides the optimizer and the three callbacks:
``BestModelCheckpoint`` (the best model by ``monitor``, written by rank 0 only) and
``broadcast_global_variables`` (Keras 3 has no global variables: a UsageError naming
what to call, on every rank, as Horovod's raises in eager mode)."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from tests.mpi.keras_backend import keras

import hvdlite.keras as hvd


def _model() -> keras.Model:
    keras.utils.set_random_seed(7)
    model = keras.Sequential([keras.layers.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05)), loss="mse")
    return model


def test_best_model_checkpoint_keeps_the_best_model_on_rank_0_only(tmp_path: Path) -> None:
    rng = np.random.default_rng(hvd.rank())
    x = rng.standard_normal((16, 4)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    path = tmp_path / f"best.{hvd.rank()}.keras"    # a path per rank: who writes shows
    checkpoint = hvd.callbacks.BestModelCheckpoint(filepath=str(path))
    assert (checkpoint.monitor, checkpoint.save_best_only, checkpoint.save_weights_only) == (
        "val_loss", True, False)
    model = _model()
    weights: list[list[np.ndarray]] = []
    record = keras.callbacks.LambdaCallback(
        on_epoch_end=lambda epoch, logs: weights.append(
            [np.array(keras.ops.convert_to_numpy(w)) for w in model.weights]))
    history = model.fit(x, y, batch_size=4, epochs=4, verbose=0, validation_data=(x, y),
                        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                                   hvd.callbacks.MetricAverageCallback(), checkpoint, record])
    assert path.exists() == (hvd.rank() == 0), os.listdir(tmp_path)
    losses = history.history["val_loss"]          # averaged over ranks, as the checkpoint saw
    if hvd.rank() == 0:
        assert checkpoint.best == pytest.approx(min(losses))
        saved = keras.models.load_model(path, compile=False)
        best = weights[int(np.argmin(losses))]
        for got, expected in zip(saved.weights, best):
            np.testing.assert_array_equal(keras.ops.convert_to_numpy(got), expected)


def test_best_model_checkpoint_takes_its_path_later_and_refuses_none() -> None:
    checkpoint = hvd.callbacks.BestModelCheckpoint(monitor="loss", mode="min")
    assert checkpoint.filepath is None and checkpoint.monitor == "loss"
    x = np.ones((4, 4), dtype="float32")
    with pytest.raises(hvd.UsageError, match="BestModelCheckpoint has no filepath"):
        _model().fit(x, x[:, :1], epochs=1, verbose=0, callbacks=[checkpoint])


def test_broadcast_global_variables_names_what_to_call() -> None:
    with pytest.raises(hvd.UsageError, match=r"broadcast_variables\(model.variables"):
        hvd.broadcast_global_variables(0)
    assert "broadcast_global_variables" in hvd.__all__
