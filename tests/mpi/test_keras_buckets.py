"""hvdlite.keras reduces a step's gradients in HVDLITE_BUCKET_BYTES buckets (one flat
allreduce each, the reducer's) on the TensorFlow backend and, with KERAS_BACKEND=torch
(make test runs this file both ways), on torch: the same weights as one bucket per
gradient (HVDLITE_BUCKET_BYTES=0), bitwise identical across ranks."""
from __future__ import annotations

from typing import Iterator

import numpy as np
import pytest

from tests.mpi.keras_backend import keras

import hvdlite.keras as hvd
from hvdlite.api import runtime
from hvdlite.api.control import reconfigure
from tests.mpi.conftest import assert_identical_everywhere, submissions


@pytest.fixture
def names() -> Iterator[list[str]]:
    """The names of what this rank hands the engine during the test (requests and
    buckets on a lane alike)."""
    previous = runtime.config().bucket_bytes
    try:
        with submissions() as seen:
            yield seen
    finally:
        reconfigure(bucket_bytes=previous)


def _fit(cap: int) -> "keras.Model":
    reconfigure(bucket_bytes=cap)
    keras.utils.set_random_seed(9)
    model = keras.Sequential([keras.layers.Input((6,), dtype="float64"),
                              keras.layers.Dense(10, activation="tanh", dtype="float64"),
                              keras.layers.Dense(10, activation="tanh", dtype="float64"),
                              keras.layers.Dense(2, dtype="float64")])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)),
                  loss=keras.losses.MeanSquaredError(dtype="float64"))
    rng = np.random.default_rng(hvd.rank())
    model.fit(rng.normal(size=(12, 6)), rng.normal(size=(12, 2)), batch_size=4, epochs=1,
              shuffle=False, verbose=0)
    return model


def test_gradients_are_reduced_in_buckets(names: list[str]) -> None:
    bucketed = _fit(400)                  # 6 tensors of 20-880 bytes: several buckets
    buckets = sorted({n for n in names if ".bucket." in n})
    assert len(buckets) >= 3, names
    assert all(n.startswith("DistributedSGD.bucket.") for n in buckets)
    names.clear()
    one_each = _fit(0)
    assert len({n for n in names if ".bucket." in n}) == len(one_each.trainable_weights)
    for a, b in zip(bucketed.get_weights(), one_each.get_weights()):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-12)
    assert_identical_everywhere(bucketed.get_weights())
