"""hvdlite.keras (Keras 3 on TensorFlow): model.fit on N ranks, each with 1/N of
every batch, reaches the weights of one process trained on the whole batch and
keeps bitwise-identical copies; callbacks, accumulation, load_model, bad input."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest

from tests.mpi.conftest import assert_identical_everywhere, keras_on_tensorflow, keras_optimizers

tf, keras = keras_on_tensorflow()

import hvdlite.keras as hvd  # noqa: E402

PER_RANK = 4           # rows per rank per micro-batch
TOLERANCE = 1e-10      # float64 model: only the summation order differs
STEPS = 6              # global batches per epoch


def _model(seed: int = 1234, hidden: int = 8) -> "keras.Model":
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.layers.Input((5,), dtype="float64"),
                             keras.layers.Dense(hidden, activation="tanh", dtype="float64"),
                             keras.layers.Dense(3, dtype="float64")])


def _mse() -> "keras.losses.Loss":
    # Keras computes losses in floatx (float32) unless told otherwise; float64 keeps
    # batchings that divide by different counts equal up to float64 rounding.
    return keras.losses.MeanSquaredError(dtype="float64")


def _data(batches: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    return rng.normal(size=(batches * rows, 5)), rng.normal(size=(batches * rows, 3))


def _shard(array: np.ndarray) -> np.ndarray:
    """This rank's PER_RANK rows of every global micro-batch."""
    n = hvd.size()
    blocks = array.reshape(-1, n, PER_RANK, array.shape[-1])
    return blocks[:, hvd.rank()].reshape(-1, array.shape[-1])


def _fit(make_opt: Callable, distributed: bool, passes: int = 1, epochs: int = 2,
         **wrap: Any) -> "keras.Model":
    model = _model()
    optimizer = make_opt()
    if distributed:
        optimizer = hvd.DistributedOptimizer(optimizer, backward_passes_per_step=passes, **wrap)
    model.compile(optimizer=optimizer, loss=_mse())
    x, y = _data(STEPS * passes, PER_RANK * hvd.size())
    if distributed:
        model.fit(_shard(x), _shard(y), batch_size=PER_RANK, epochs=epochs, shuffle=False,
                  verbose=0)
    else:
        model.fit(x, y, batch_size=PER_RANK * hvd.size() * passes, epochs=epochs,
                  shuffle=False, verbose=0)
    return model


def _assert_close(got: "keras.Model", want: "keras.Model") -> None:
    for a, b in zip(got.get_weights(), want.get_weights()):
        np.testing.assert_allclose(a, b, rtol=0, atol=TOLERANCE)
    assert any(not np.array_equal(a, b) for a, b in zip(got.get_weights(),
                                                         _model().get_weights()))


def _assert_identical_everywhere(model: "keras.Model") -> None:
    assert_identical_everywhere(model.get_weights())


OPTIMIZERS = keras_optimizers(keras)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_fit_on_n_ranks_matches_one_process_on_the_whole_batch(name: str) -> None:
    distributed = _fit(OPTIMIZERS[name], True)
    _assert_close(distributed, _fit(OPTIMIZERS[name], False))
    _assert_identical_everywhere(distributed)


def test_backward_passes_per_step_equals_local_accumulation() -> None:
    make = OPTIMIZERS["sgd"]
    averaged = _fit(make, True, passes=3, average_aggregated_gradients=True)
    _assert_close(averaged, _fit(make, False, passes=3))
    assert int(averaged.optimizer.iterations) == 2 * STEPS     # applied updates only
    # Summed (Horovod's default): k times the gradient, i.e. k times the rate here
    # (rates exact in float32, the learning-rate variable's dtype).
    summed = _fit(lambda: keras.optimizers.SGD(0.125, momentum=0.9), True, passes=3)
    _assert_close(summed, _fit(lambda: keras.optimizers.SGD(0.375, momentum=0.9), False,
                               passes=3))
    _assert_identical_everywhere(summed)


def test_custom_loop_apply_gradients_and_apply() -> None:
    model = _model()
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1))
    x, y = _data(1, PER_RANK * hvd.size())

    @tf.function
    def step(xs: tf.Tensor, ys: tf.Tensor, use_apply: bool) -> None:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(xs) - ys) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        if use_apply:
            optimizer.apply(grads, model.trainable_variables)
        else:
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
    step(tf.constant(_shard(x)), tf.constant(_shard(y)), False)
    step(tf.constant(_shard(x)), tf.constant(_shard(y)), True)
    _assert_identical_everywhere(model)
    assert int(optimizer.iterations) == 2


def test_broadcast_callback_makes_different_weights_equal() -> None:
    model = _model(seed=100 + hvd.rank())
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.0)), loss=_mse())
    x, y = _data(1, PER_RANK)
    model.fit(x, y, batch_size=PER_RANK, epochs=1, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    want = _model(seed=100).get_weights()
    for a, b in zip(model.get_weights(), want):
        np.testing.assert_array_equal(a, b)


class _Recorder(keras.callbacks.Callback):
    def __init__(self) -> None:
        super().__init__()
        self.epoch_logs: list[dict] = []
        self.rates: list[float] = []

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        self.rates.append(float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)))

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.epoch_logs.append(dict(logs or {}))


def test_metric_average_callback_logs_the_mean_over_ranks() -> None:
    model = _model()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss=_mse(),
                  metrics=["mae"])
    x, y = _data(2, PER_RANK)
    raw = _Recorder()                       # before the average: this rank's own values
    history = model.fit(x, y * (hvd.rank() + 1), batch_size=PER_RANK, epochs=2, verbose=0,
                        callbacks=[raw, hvd.callbacks.MetricAverageCallback()])
    every = hvd.allgather_object(raw.epoch_logs)
    for epoch in range(2):
        for key in ("loss", "mae"):
            mean = np.mean([logs[epoch][key] for logs in every])
            assert history.history[key][epoch] == pytest.approx(mean, rel=1e-12)
    assert len({round(logs[0]["loss"], 12) for logs in every}) == hvd.size()


def test_warmup_and_schedule_follow_horovods_formulas() -> None:
    n, steps, lr = hvd.size(), 4, 0.2
    model = _model()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(lr, momentum=0.9)),
                  loss=_mse())
    x, y = _data(steps, PER_RANK)
    recorder = _Recorder()
    callbacks = [hvd.callbacks.LearningRateWarmupCallback(lr, warmup_epochs=2),
                 hvd.callbacks.LearningRateScheduleCallback(lr, 0.1, start_epoch=2,
                                                            end_epoch=3),
                 hvd.callbacks.LearningRateScheduleCallback(lr, lambda e: 0.5 ** e,
                                                            start_epoch=3), recorder]
    model.fit(x, y, batch_size=PER_RANK, epochs=5, verbose=0, callbacks=callbacks)
    expected = []
    for epoch in range(5):
        for batch in range(steps):
            e = epoch + (batch + 1) / steps      # warm-up: where the batch ends
            if epoch < 2:
                expected.append(lr / n * (e * (n - 1) / 2 + 1))
            else:
                expected.append(lr * (0.1 if epoch == 2 else 0.5 ** epoch))
    np.testing.assert_allclose(recorder.rates, expected, rtol=1e-6)
    assert model.optimizer.momentum == 0.9      # momentum correction is undone each batch


def test_load_model_rewraps_the_optimizer_with_its_state(tmp_path: Any) -> None:
    model = _fit(OPTIMIZERS["sgd"], True, epochs=1)
    path = str(tmp_path / f"model_{hvd.rank()}.keras")
    model.save(path)
    loaded = hvd.load_model(path)
    assert type(loaded.optimizer).__name__ == "SGD"
    assert "_Distributed" in [c.__name__ for c in type(loaded.optimizer).__mro__]
    assert int(loaded.optimizer.iterations) == int(model.optimizer.iterations) == STEPS
    for a, b in zip(loaded.optimizer.variables, model.optimizer.variables):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b))
    plain = keras.models.load_model(path)       # loads without hvdlite too
    assert "_Distributed" not in [c.__name__ for c in type(plain.optimizer).__mro__]
    x, y = _data(STEPS, PER_RANK * hvd.size())
    loaded.fit(_shard(x), _shard(y), batch_size=PER_RANK, epochs=1, verbose=0, shuffle=False)
    _assert_identical_everywhere(loaded)


def test_jit_compile_true_trains_without_xla() -> None:
    model = _model()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss=_mse(),
                  jit_compile=True)
    x, y = _data(2, PER_RANK)
    model.fit(x, y, batch_size=PER_RANK, epochs=1, verbose=0)
    assert model.jit_compile is False
    _assert_identical_everywhere(model)


def test_wrapping_something_else_is_a_type_error() -> None:
    for bad in ("sgd", tf.optimizers.schedules.ExponentialDecay(0.1, 10, 0.9), None):
        with pytest.raises(TypeError, match=type(bad).__name__):
            hvd.DistributedOptimizer(bad)
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(), backward_passes_per_step=0)


def test_models_that_differ_across_ranks_raise_mismatch_on_every_rank() -> None:
    model = _model(hidden=8 + hvd.rank())
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss=_mse())
    x, y = _data(1, PER_RANK)
    with pytest.raises(hvd.MismatchError, match="dense.*kernel"):
        model.fit(x, y, batch_size=PER_RANK, epochs=1, verbose=0)
