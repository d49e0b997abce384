"""hvdlite.keras callbacks and worker-local variables inside model.fit (Keras 3 on
TensorFlow; make test also runs this file with KERAS_BACKEND=torch):

- the warm-up reaches ``initial_lr`` exactly on its last batch and keeps it;
- BroadcastGlobalVariablesCallback on a built model makes the first step start
  from the root's weights, and on a lazily built model (no Input: Keras creates
  the variables inside the first step) leaves every rank identical from the end
  of the first batch on, instead of failing at step 1;
- ``local_variables`` / ``register_local_var`` / ``PartialDistributedOptimizer``
  keep a variable per rank: not broadcast, its gradient not reduced but divided
  by the number of ranks (Horovod's scale_local_gradients);
- a checkpoint loaded on rank 0 only (Horovod's resume pattern) resumes every rank
  from the root's weights and optimizer state.
"""
from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import pytest

from tests.mpi.keras_backend import keras

import hvdlite.keras as hvd

ROWS, STEPS = 4, 4


def _numpy(variables: Any) -> list[np.ndarray]:
    return [np.array(keras.ops.convert_to_numpy(v)) for v in variables]


def _digest(arrays: list[np.ndarray]) -> str:
    return hashlib.sha256(b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)).hexdigest()


def _same_everywhere(arrays: list[np.ndarray]) -> bool:
    return len(set(hvd.allgather_object(_digest(arrays)))) == 1


def _data(seed: int, steps: int = STEPS, features: int = 5) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(steps * ROWS, features)).astype("float32"),
            rng.normal(size=(steps * ROWS, 2)).astype("float32"))


class _Rates(keras.callbacks.Callback):
    """The learning rate each batch runs at (put after the schedule callbacks)."""

    def __init__(self) -> None:
        super().__init__()
        self.rates: list[np.float32] = []

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        self.rates.append(np.float32(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)))


def test_warmup_ends_exactly_at_initial_lr_and_keeps_it() -> None:
    """The issue's case: initial_lr=0.4, 2 warm-up epochs of 4 steps. The last
    warm-up batch runs at 0.4 (it used to stay at 0.4 * (1 - 1 / (8 * size)))."""
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.layers.Input((5,)), keras.layers.Dense(2)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.4)), loss="mse")
    rates = _Rates()
    x, y = _data(3)
    model.fit(x, y, batch_size=ROWS, epochs=4, verbose=0, shuffle=False, callbacks=[
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.4, warmup_epochs=2), rates])
    n = hvd.size()
    ramp = [np.float32(0.4 * ((b + 1) / STEPS * (n - 1) / 2 + 1) / n) for b in range(2 * STEPS)]
    assert rates.rates[:2 * STEPS] == ramp
    assert rates.rates[2 * STEPS - 1] == np.float32(0.4)       # the last warm-up batch
    assert rates.rates[2 * STEPS:] == [np.float32(0.4)] * (2 * STEPS)
    assert np.float32(keras.ops.convert_to_numpy(model.optimizer.learning_rate)) == np.float32(0.4)


class _Digests(keras.callbacks.Callback):
    """Whether every rank holds the same model and optimizer state, at the first
    batch's start and at each batch's end (put after the broadcast callback)."""

    def __init__(self) -> None:
        super().__init__()
        self.first_start: bool = False
        self.ends: list[bool] = []

    def _state(self) -> list[np.ndarray]:
        optimizer = self.model.optimizer
        return _numpy(self.model.variables) + (_numpy(optimizer.variables) if optimizer.built
                                               else [])

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        if batch == 0 and not self.ends and self.model.variables:
            self.first_start = _same_everywhere(self._state())

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.ends.append(_same_everywhere(self._state()))


def _layers() -> list:
    return [keras.layers.Dense(6, activation="tanh"), keras.layers.Dense(2)]


@pytest.mark.parametrize("built", [True, False], ids=["built", "lazily_built"])
def test_broadcast_callback_makes_every_rank_identical(built: bool) -> None:
    keras.utils.set_random_seed(100 + hvd.rank())     # a different start on every rank
    model = keras.Sequential(([keras.layers.Input((5,))] if built else []) + _layers())
    assert bool(model.variables) == built
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss="mse")
    digests = _Digests()
    x, y = _data(7 + hvd.rank())
    model.fit(x, y, batch_size=ROWS, epochs=2, verbose=0, callbacks=[
        hvd.callbacks.BroadcastGlobalVariablesCallback(0), digests])
    assert digests.ends == [True] * (2 * STEPS)
    # A built model is broadcast before the first step, so it starts from the root's
    # weights. A lazily built one has no variables until Keras builds it: inside the
    # first step on TensorFlow (identical from that step's end), before training
    # begins on torch (Keras' torch trainer builds it from the first batch's shapes).
    if built or keras.backend.backend() == "torch":
        assert digests.first_start
    else:
        assert not digests.first_start


def _compiled_model() -> "keras.Model":
    model = keras.Sequential([keras.layers.Input((5,))] + _layers())
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01, momentum=0.9)),
                  loss="mse")
    return model


def test_a_checkpoint_loaded_by_the_root_only_resumes_every_rank(tmp_path: Any) -> None:
    """Horovod's resume pattern (keras_imagenet_resnet50.py): rank 0 loads the checkpoint
    with hvd.load_model, its optimizer built and holding its state; the other ranks build
    and compile the model afresh. The broadcast callback gives every rank the root's
    weights and optimizer state (momentum, iterations) before the first step."""
    keras.utils.set_random_seed(5)
    x, y = _data(11 + hvd.rank())
    trained = _compiled_model()
    trained.fit(x, y, batch_size=ROWS, epochs=1, verbose=0,
                callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    path = str(tmp_path / "checkpoint-1.keras")      # written and read by rank 0 only
    if hvd.rank() == 0:
        trained.save(path)
    keras.utils.set_random_seed(100 + hvd.rank())    # a different start on every rank
    model = hvd.load_model(path) if hvd.rank() == 0 else _compiled_model()
    digests = _Digests()
    model.fit(x, y, batch_size=ROWS, epochs=2, initial_epoch=1, verbose=0, callbacks=[
        hvd.callbacks.BroadcastGlobalVariablesCallback(0), digests])
    assert digests.first_start and digests.ends == [True] * STEPS
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 2 * STEPS


def _rank_valued_model(trainable: bool) -> "keras.Model":
    value = keras.initializers.Constant(float(hvd.rank()))
    dense = [keras.layers.Dense(3, kernel_initializer=value, bias_initializer=value,
                                trainable=trainable) for _ in range(3)]
    return keras.Sequential([keras.layers.Input((3,))] + dense)


@pytest.mark.parametrize("how", ["argument", "register_local_var"])
def test_local_variables_keep_each_ranks_value(how: str) -> None:
    root = hvd.size() - 1
    model = _rank_valued_model(trainable=False)
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    local = list(model.layers[0].variables)
    if how == "argument":
        callback = hvd.callbacks.BroadcastGlobalVariablesCallback(root, local_variables=local)
    else:
        callback = hvd.callbacks.BroadcastGlobalVariablesCallback(root)
        for variable in local:
            callback.register_local_var(variable)
    x, y = np.ones((ROWS, 3), "float32"), np.ones((ROWS, 3), "float32")
    model.fit(x, y, batch_size=ROWS, epochs=1, verbose=0, callbacks=[callback])
    ids = {id(v) for v in local}
    for variable, value in zip(model.variables, _numpy(model.variables)):
        expected = hvd.rank() if id(variable) in ids else root
        np.testing.assert_array_equal(value, np.full(value.shape, float(expected), "float32"))


def _one_step(optimizer: Any, x: np.ndarray, y: np.ndarray) -> tuple[list, list]:
    """(weights before, weights after) one model.fit step of a rank-valued model."""
    model = _rank_valued_model(trainable=True)
    model.compile(optimizer=optimizer, loss="mse")
    before = _numpy(model.trainable_variables)
    model.fit(x, y, batch_size=len(x), epochs=1, verbose=0)
    return before, _numpy(model.trainable_variables)


@pytest.mark.parametrize("how", ["local_layers", "register_local_var"])
def test_partial_optimizer_reduces_only_the_shared_gradients(how: str) -> None:
    x, y = _data(11 + hvd.rank(), steps=1, features=3)
    y = np.concatenate([y, y[:, :1]], axis=1)
    plain_before, plain_after = _one_step(keras.optimizers.SGD(0.5), x, y)
    plain_steps = [a - b for a, b in zip(plain_after, plain_before)]

    model = _rank_valued_model(trainable=True)
    if how == "local_layers":
        optimizer = hvd.PartialDistributedOptimizer(keras.optimizers.SGD(0.5),
                                                    local_layers=[model.layers[0]])
    else:
        optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(0.5))
        for variable in model.layers[0].trainable_variables:
            optimizer.register_local_var(variable)
    model.compile(optimizer=optimizer, loss="mse")
    before = _numpy(model.trainable_variables)
    model.fit(x, y, batch_size=len(x), epochs=1, verbose=0)
    steps = [a - b for a, b in zip(_numpy(model.trainable_variables), before)]

    every_rank = hvd.allgather_object(plain_steps)
    local = len(model.layers[0].trainable_variables)
    for i, step in enumerate(steps):
        if i < local:      # this rank's own gradient, divided by the number of ranks
            np.testing.assert_allclose(step, plain_steps[i] / hvd.size(), rtol=1e-5, atol=1e-7)
        else:              # the mean over ranks
            mean = np.mean([steps_of_rank[i] for steps_of_rank in every_rank], axis=0)
            np.testing.assert_allclose(step, mean, rtol=1e-5, atol=1e-6)
    assert _same_everywhere([s for i, s in enumerate(steps) if i >= local])


def test_bad_local_arguments_are_type_errors_on_every_rank() -> None:
    model = _rank_valued_model(trainable=True)
    with pytest.raises(TypeError, match="local_layers holds Keras layers; got str"):
        hvd.PartialDistributedOptimizer(keras.optimizers.SGD(0.1), local_layers=["dense"])
    with pytest.raises(TypeError, match="register_local_var takes a Keras or TensorFlow "
                                        "variable; got"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)).register_local_var(3.0)
    with pytest.raises(TypeError, match="a local variable must be a Keras or TensorFlow"):
        hvd.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=[model.layers[0]])
