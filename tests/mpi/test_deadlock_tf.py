"""A TensorFlow training loop (DistributedGradientTape) over uneven shards, eager and
in a tf.function: rank 0 runs out of batches and averages its epoch loss while the
others wait on the next step's gradients. Every rank raises the deadlock within
HVDLITE_STALL_CHECK_TIME."""
from __future__ import annotations

import pytest

from tests.mpi.conftest import keras_on_tensorflow

tf, _ = keras_on_tensorflow()

import hvdlite.tensorflow as hvd  # noqa: E402
from tests.mpi.deadlock_case import (BATCH, Warnings, check_deadlock, first_error,  # noqa: E402
                                     recovered, shard)
from tests.mpi.deadlock_case import short_stall_check  # noqa: F401,E402  (fixture)

pytestmark = pytest.mark.timeout(90)


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf_function"])
def test_a_tape_loop_over_uneven_shards(short_stall_check: Warnings, traced: bool) -> None:
    if hvd.size() < 2:
        pytest.skip("needs two ranks")
    weights = tf.Variable(tf.zeros((5, 1)), name="w")
    x, y = shard(hvd.rank())

    def step(features: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((features @ weights - labels) ** 2)
        tape = hvd.DistributedGradientTape(tape)
        (grad,) = tape.gradient(loss, [weights])
        weights.assign_sub(0.01 * grad)
        return loss
    step = tf.function(step) if traced else step
    tag = "traced" if traced else "eager"

    def train() -> None:
        for epoch in range(2):
            for start in range(0, len(x), BATCH):
                loss = step(x[start:start + BATCH], y[start:start + BATCH])
            hvd.allreduce(loss, name=f"tf.epoch.loss.{tag}.{epoch}")
    error = first_error(train)
    after = recovered(f"tf.{tag}")
    check_deadlock(error, after, {"rank 0": f"tf.epoch.loss.{tag}.0", "others": ""})
