"""HVDLITE_AUTOTUNE under Keras on TensorFlow: model.fit marks each step boundary from a
py_function inside the traced train step, which TensorFlow runs on pool threads whose
names differ between ranks; the tuner's collectives and its reconfigure are named, so
they still pair (an unnamed reconfigure stalled there: each rank waited on its own
thread's name). Every rank finishes the search at the same step with the same trials.
A fake clock (a second per reading) keeps the trials, not the timings, under test."""
from __future__ import annotations

from typing import Iterator

import numpy as np
import pytest

from tests.mpi.conftest import keras_on_tensorflow

tf, keras = keras_on_tensorflow()

import hvdlite.keras as hvd  # noqa: E402
from hvdlite.api import runtime  # noqa: E402
from hvdlite.api.control import reconfigure  # noqa: E402
from hvdlite.diagnostics import autotune
from hvdlite.policy.tuning import Knob  # noqa: E402


@pytest.fixture
def stall_fails() -> Iterator[None]:
    """A stall becomes a StallError (a failure) instead of a hang; settings restored."""
    config = runtime.config()
    before = {name: getattr(config, name) for name in
              ("stall_shutdown_time", "stall_check_time", "spin_time", "cycle_time")}
    reconfigure(stall_shutdown_time=30.0, stall_check_time=10.0)
    yield
    reconfigure(**before)


class Ticks:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def test_keras_fit_on_tensorflow_tunes_and_agrees(stall_fails: None) -> None:
    config = runtime.config().replace(autotune_warmup_steps=1, autotune_steps_per_sample=1)
    # The current spin (a topology-aware default at -n 2) and one other: one spin_time trial.
    knobs = [Knob("spin_time", (0.0, float(config.spin_time))),
             Knob("cycle_time", (0.25, 1.0, 5.0))]
    tuner = autotune.Tuner(config, hvd.rank(), fixed=set(), clock=Ticks(),
                           planner=lambda observed: knobs)
    detach = autotune.attach(tuner)        # before the train step is traced: it marks steps
    try:
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.layers.Input((5,)), keras.layers.Dense(4),
                                  keras.layers.Dense(1)])
        model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)),
                      loss="mse")
        x = np.random.default_rng(hvd.rank()).normal(size=(64, 5))
        for _ in range(10):
            model.fit(x, x[:, :1], batch_size=4, epochs=1, shuffle=False, verbose=0)
            if tuner.finished:
                break
    finally:
        detach()
    assert tuner.finished
    assert [t["phase"] for t in tuner.trials] == ["baseline", "spin_time", "cycle_time",
                                                   "cycle_time"]
    everyone = hvd.allgather_object((tuner.tuning_steps, tuner.trials, tuner.settings))
    assert all(entry == everyone[0] for entry in everyone)
