"""Keras fit with Horovod's three standard callbacks over uneven shards (rank 0: 64
samples, the others 96, batches of 16): rank 0 waits in the epoch's metric average,
the others on the next step's gradients. Every rank raises the deadlock within
HVDLITE_STALL_CHECK_TIME (make test also runs this file with KERAS_BACKEND=torch)."""
from __future__ import annotations

import pytest

from tests.mpi.keras_backend import keras

import hvdlite.keras as hvd  # noqa: E402
from tests.mpi.deadlock_case import (BATCH, Warnings, check_deadlock, first_error,  # noqa: E402
                                     recovered, shard)
from tests.mpi.deadlock_case import short_stall_check  # noqa: F401,E402  (fixture)

pytestmark = pytest.mark.timeout(90)


def test_fit_with_the_standard_callbacks_over_uneven_shards(short_stall_check: Warnings) -> None:
    if hvd.size() < 2:
        pytest.skip("needs two ranks")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.layers.Input((5,)), keras.layers.Dense(1)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                 hvd.callbacks.MetricAverageCallback(),
                 hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.01, warmup_epochs=1)]
    x, y = shard(hvd.rank())
    error = first_error(lambda: model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0,
                                          callbacks=callbacks))
    after = recovered("keras")
    check_deadlock(error, after, {"rank 0": "MetricAverageCallback.0",
                                  "others": "DistributedSGD.bucket.0"})
