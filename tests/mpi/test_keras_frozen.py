"""hvdlite.keras with variables that get no gradient or change whether they train, on
the TensorFlow backend and (make test runs this file both ways) on torch: an output
no loss reaches, a layer frozen between fits (recompiled with the same optimizer, as
Keras allows), one unfrozen between fits (with a new optimizer, as Keras requires),
one frozen by a callback during a fit (whatever Keras does with that on the backend).
In every case N ranks on 1/N of each batch reach one process's weights on the whole
batch (within TOLERANCE) and hold bitwise-identical copies; a variable no rank has
a gradient for is left alone by Adam, as in one process."""
from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np
import pytest

from tests.mpi.keras_backend import keras

import hvdlite.keras as hvd
from tests.mpi.conftest import assert_identical_everywhere

PER_RANK = 4
# float64 on TensorFlow: only the summation order differs. Keras's torch backend rounds
# its float64 gradients to float32 size between batch splits (see test_keras_torch.py).
TOLERANCE = 1e-10 if keras.backend.backend() == "tensorflow" else 1e-6
BATCHES = 5            # global batches per fit


def _model() -> "keras.Model":
    """Two Dense layers to a loss, and an auxiliary output no loss reaches."""
    keras.utils.set_random_seed(1234)
    inputs = keras.layers.Input((5,), dtype="float64")
    hidden = keras.layers.Dense(8, activation="tanh", dtype="float64", name="trunk")(inputs)
    out = keras.layers.Dense(3, dtype="float64", name="head")(hidden)
    aux = keras.layers.Dense(2, dtype="float64", name="aux")(hidden)
    return keras.Model(inputs, [out, aux])


def _compile(model: "keras.Model", optimizer: Any, aux_loss: bool = False) -> None:
    mse = keras.losses.MeanSquaredError(dtype="float64")
    model.compile(optimizer=optimizer, loss=[mse, mse if aux_loss else None])


def _data(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    rows = BATCHES * PER_RANK * hvd.size()
    return rng.normal(size=(rows, 5)), rng.normal(size=(rows, 3))


def _shard(array: np.ndarray) -> np.ndarray:
    """This rank's PER_RANK rows of every global batch."""
    blocks = array.reshape(-1, hvd.size(), PER_RANK, array.shape[-1])
    return blocks[:, hvd.rank()].reshape(-1, array.shape[-1])


def _fit(model: "keras.Model", distributed: bool, seed: int,
         callbacks: Optional[list] = None) -> None:
    x, y = _data(seed)
    if distributed:
        x, y, batch = _shard(x), _shard(y), PER_RANK
    else:
        batch = PER_RANK * hvd.size()
    model.fit(x, [y, y[:, :2]], batch_size=batch, epochs=1, shuffle=False, verbose=0,
              callbacks=callbacks or [])


def _adam(distributed: bool) -> Any:
    optimizer = keras.optimizers.Adam(0.01)
    return hvd.DistributedOptimizer(optimizer) if distributed else optimizer


Scenario = Callable[[bool], "keras.Model"]


def _assert_matches_one_process(scenario: Scenario) -> "keras.Model":
    distributed, reference = scenario(True), scenario(False)
    for got, want in zip(distributed.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE)
    assert_identical_everywhere(distributed.get_weights())
    return distributed


def _weights(model: "keras.Model", layer: str) -> list:
    return [np.array(w) for w in model.get_layer(layer).get_weights()]


def _unchanged(model: "keras.Model", layer: str, before: list) -> bool:
    return all(np.array_equal(a, b) for a, b in zip(_weights(model, layer), before))


def test_an_output_no_loss_reaches_is_left_alone_by_adam() -> None:
    """Trained with a loss on it first (Adam's moments of it are not zero), then fit
    without: its gradients are None on every rank, so Adam must not move it."""
    before = {}

    def scenario(distributed: bool) -> "keras.Model":
        model = _model()
        optimizer = _adam(distributed)
        _compile(model, optimizer, aux_loss=True)
        _fit(model, distributed, seed=1)
        before[distributed] = _weights(model, "aux")
        _compile(model, optimizer)
        _fit(model, distributed, seed=2)
        return model
    model = _assert_matches_one_process(scenario)
    assert _unchanged(model, "aux", before[True])
    assert not _unchanged(model, "head", _weights(_model(), "head"))


def test_a_layer_frozen_between_fits_stops_where_one_process_stops() -> None:
    frozen = {}

    def scenario(distributed: bool) -> "keras.Model":
        model = _model()
        optimizer = _adam(distributed)
        _compile(model, optimizer)
        _fit(model, distributed, seed=1)
        model.get_layer("trunk").trainable = False
        _compile(model, optimizer)          # the same optimizer: Keras allows fewer variables
        frozen[distributed] = _weights(model, "trunk")
        _fit(model, distributed, seed=2)
        assert _unchanged(model, "trunk", frozen[distributed])
        return model
    _assert_matches_one_process(scenario)


def test_a_layer_unfrozen_between_fits_is_averaged() -> None:
    def scenario(distributed: bool) -> "keras.Model":
        model = _model()
        model.get_layer("trunk").trainable = False
        _compile(model, _adam(distributed))
        _fit(model, distributed, seed=1)
        model.get_layer("trunk").trainable = True
        _compile(model, _adam(distributed))  # Keras refuses new variables to a built one
        _fit(model, distributed, seed=2)
        return model
    model = _assert_matches_one_process(scenario)
    assert not _unchanged(model, "trunk", _weights(_model(), "trunk"))


class _FreezeAt(keras.callbacks.Callback):
    def __init__(self, batch: int, layer: str) -> None:
        super().__init__()
        self.batch, self.layer = batch, layer

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        if batch == self.batch:
            self.model.get_layer(self.layer).trainable = False


def test_a_layer_frozen_by_a_callback_during_a_fit_trains_as_in_one_process() -> None:
    """Keras on torch stops training it at once (its step is eager); on TensorFlow the
    traced step keeps the variables it was traced with. Either way, as one process."""
    def scenario(distributed: bool) -> "keras.Model":
        model = _model()
        _compile(model, _adam(distributed))
        _fit(model, distributed, seed=1, callbacks=[_FreezeAt(2, "trunk")])
        return model
    _assert_matches_one_process(scenario)


def test_ranks_that_freeze_different_layers_get_a_mismatch_error() -> None:
    if hvd.size() < 2:
        pytest.skip("needs two ranks to differ")
    model = _model()
    model.get_layer("trunk" if hvd.rank() == 0 else "head").trainable = False
    _compile(model, hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)))
    with pytest.raises(hvd.MismatchError, match=rf"rank {hvd.rank()}: .*variables differ"):
        _fit(model, True, seed=1)


def test_ranks_that_freeze_different_layers_of_one_shape_get_a_mismatch_error() -> None:
    """Each rank's trained variables have the same shapes, in the same order, so only
    which of the optimizer's variables each rank trains tells them apart: unnoticed,
    one rank's 'left' gradients would be averaged with another's 'right' ones."""
    if hvd.size() < 2:
        pytest.skip("needs two ranks to differ")
    keras.utils.set_random_seed(1234)
    inputs = keras.layers.Input((5,), dtype="float64")
    left = keras.layers.Dense(4, dtype="float64", name="left")(inputs)
    right = keras.layers.Dense(4, dtype="float64", name="right")(inputs)
    model = keras.Model(inputs, keras.layers.Add(dtype="float64")([left, right]))
    optimizer = hvd.DistributedOptimizer(keras.optimizers.Adam(0.01))
    model.compile(optimizer=optimizer, loss=keras.losses.MeanSquaredError(dtype="float64"))
    x = np.random.default_rng(hvd.rank()).normal(size=(2 * PER_RANK, 5))
    model.fit(x, x[:, :4], batch_size=PER_RANK, epochs=1, shuffle=False, verbose=0)
    model.get_layer("left" if hvd.rank() == 0 else "right").trainable = False
    model.compile(optimizer=optimizer, loss=keras.losses.MeanSquaredError(dtype="float64"))
    with pytest.raises(hvd.MismatchError, match=rf"rank {hvd.rank()}: .*variables differ"
                                                r".*Freeze and unfreeze"):
        model.fit(x, x[:, :4], batch_size=PER_RANK, epochs=1, shuffle=False, verbose=0)
