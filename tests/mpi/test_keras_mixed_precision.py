"""Mixed precision over hvdlite.keras's DistributedOptimizer (Keras 3 on TensorFlow;
make test also runs this file with KERAS_BACKEND=torch): when one rank's gradients
overflow, Keras' LossScaleOptimizer skips the step on every rank, not only there.
No rank waits for an allreduce another skipped; every rank ends with bitwise the same
weights, the same loss scale and the same number of applied updates. Checked in
model.fit under the "mixed_float16" policy (the LossScaleOptimizer compile puts
around the optimizer) and, exactly, in apply calls: wrapped either way round, with
backward_passes_per_step, and with the overflow in a worker-local variable's
gradient only."""
from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import pytest

from tests.mpi.keras_backend import keras

import hvdlite.keras as hvd
from tests.mpi.conftest import assert_identical_everywhere
from tests.mpi.deadlock_case import first_error, short_stall_check  # noqa: F401  (fixture)

# On the code this guards, a skipped allreduce became a DeadlockError after half of
# the short stall check time: fail fast rather than wait for the timeout.
pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("short_stall_check")]

INITIAL_SCALE = 2.0 ** 15          # Keras' default: it halves once per skipped step
BATCH, STEPS, OVERFLOWING_STEP = 8, 6, 2


@pytest.fixture
def mixed_float16() -> Iterator[None]:
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        yield
    finally:
        keras.mixed_precision.set_global_policy("float32")


def _numpy(variable: Any) -> np.ndarray:
    return np.asarray(keras.ops.convert_to_numpy(variable))


def _scalar(variable: Any) -> float:
    return float(_numpy(variable))


def _shard(rank: int) -> tuple[np.ndarray, np.ndarray]:
    """The issue's data; on the last rank one sample of one batch overflows float16."""
    rng = np.random.default_rng(rank)
    x = rng.standard_normal((BATCH * STEPS, 20)).astype("float32")
    if rank == hvd.size() - 1:
        x[BATCH * OVERFLOWING_STEP + 3] = 6e4
    return x, rng.integers(0, 3, BATCH * STEPS)


def test_fit_skips_the_overflowing_step_on_every_rank(mixed_float16: None) -> None:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.layers.Input((20,)), keras.layers.Dense(16),
                              keras.layers.Dense(3),
                              keras.layers.Activation("linear", dtype="float32")])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = _shard(hvd.rank())
    error = first_error(lambda: model.fit(
        x, y, batch_size=BATCH, epochs=2, verbose=0, shuffle=False,
        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                   hvd.callbacks.MetricAverageCallback()]))
    scaler = model.optimizer
    assert_identical_everywhere(model.get_weights() + [_numpy(scaler.dynamic_scale),
                                                       _numpy(scaler.iterations)])
    assert error is None, error
    assert isinstance(scaler, keras.optimizers.LossScaleOptimizer)
    # The overflowing batch comes once an epoch; the scale halves at each.
    assert _scalar(scaler.iterations) == 2 * (STEPS - 1)
    assert _scalar(scaler.dynamic_scale) == INITIAL_SCALE / 4
    assert all(np.isfinite(w).all() for w in model.get_weights())


def _scaled_optimizer(order: str, passes: int) -> Any:
    sgd = keras.optimizers.SGD(1.0)
    if order == "scale outside":   # as model.compile wraps it
        return keras.optimizers.LossScaleOptimizer(
            hvd.DistributedOptimizer(sgd, backward_passes_per_step=passes), initial_scale=4.0)
    return hvd.DistributedOptimizer(keras.optimizers.LossScaleOptimizer(sgd, initial_scale=4.0),
                                    backward_passes_per_step=passes)


@pytest.mark.parametrize("order,passes", [("scale outside", 1), ("scale outside", 2),
                                          ("scale inside", 1)])
def test_apply_skips_an_update_that_overflowed_on_one_rank(order: str, passes: int) -> None:
    """Rank r's (scaled) gradient is (r + 1) * scale; the last rank's first one has an
    inf. The first update (the first ``passes`` calls) is skipped on every rank and the
    scale halves to 2; the second applies the average, unscaled, summed over passes."""
    optimizer = _scaled_optimizer(order, passes)
    weights = keras.Variable(np.zeros(3, "float32"))
    last, size = hvd.rank() == hvd.size() - 1, hvd.size()
    after_first = None
    for call in range(2 * passes):
        scale = _scalar(optimizer.dynamic_scale) if optimizer.built else 4.0
        grad = np.full(3, (hvd.rank() + 1) * scale, "float32")
        if call == 0 and last:
            grad[1] = np.inf
        optimizer.apply([keras.ops.convert_to_tensor(grad)], [weights])
        if call == passes - 1:
            after_first = (keras.ops.convert_to_numpy(weights).copy(),
                           _scalar(optimizer.dynamic_scale), _scalar(optimizer.iterations))
    assert_identical_everywhere([_numpy(weights), _numpy(optimizer.dynamic_scale)])
    np.testing.assert_array_equal(after_first[0], np.zeros(3))
    assert after_first[1:] == (2.0, 0)
    mean = (size + 1) / 2
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(weights),
                                  np.full(3, -passes * mean, "float32"))
    assert _scalar(optimizer.iterations) == 1


def test_an_overflow_in_a_local_variables_gradient_skips_everywhere() -> None:
    """A worker-local variable's gradient is not averaged: the last rank's inf there
    still skips the update on every rank (and the shared weights stay the same)."""
    optimizer = keras.optimizers.LossScaleOptimizer(
        hvd.DistributedOptimizer(keras.optimizers.SGD(1.0)), initial_scale=4.0)
    shared = keras.Variable(np.zeros(2, "float32"))
    local = keras.Variable(np.zeros(2, "float32"))
    optimizer.inner_optimizer.register_local_var(local)
    overflowing = np.array([np.inf if hvd.rank() == hvd.size() - 1 else 1.0, 1.0], "float32")
    optimizer.apply([keras.ops.convert_to_tensor(np.ones(2, "float32")),
                     keras.ops.convert_to_tensor(overflowing)], [shared, local])
    assert_identical_everywhere([_numpy(shared), _numpy(optimizer.dynamic_scale)])
    assert _scalar(optimizer.iterations) == 0
    assert _scalar(optimizer.dynamic_scale) == 2.0
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(shared), np.zeros(2))
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(local), np.zeros(2))
