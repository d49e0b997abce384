"""hvd.elastic for Keras 3 on the torch backend (make test runs this file with
KERAS_BACKEND=torch; in a TensorFlow-backend run it skips): KerasState syncs,
commits and restores the model and optimizer variables bitwise (iterations
included) and the callbacks commit every N batches inside hvd.elastic.run."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

keras = pytest.importorskip("keras")
if keras.backend.backend() != "torch":
    pytest.skip("run with KERAS_BACKEND=torch (make test does)", allow_module_level=True)
torch = pytest.importorskip("torch")
torch.set_num_threads(1)

import hvdlite.keras as hvd  # noqa: E402
from hvdlite.elastic.model_state import ModelState  # noqa: E402
from tests.mpi.conftest import assert_identical_everywhere  # noqa: E402

pytestmark = pytest.mark.timeout(120)
BATCH = 4


def _variables(model: "keras.Model") -> list[np.ndarray]:
    return [np.array(v.numpy()) for v in model.variables + model.optimizer.variables]


def test_keras_state_and_callbacks_on_the_torch_backend() -> None:
    keras.utils.set_random_seed(hvd.rank())
    model = keras.Sequential([keras.layers.Input((5,)), keras.layers.Dense(4, activation="tanh"),
                              keras.layers.Dropout(0.25), keras.layers.Dense(2)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss="mse")
    state = hvd.elastic.KerasState(model, epoch=0, batch=0)
    commits: list[tuple[int, int]] = []
    commit = state.commit
    state.commit = lambda: (commits.append((state.epoch, state.batch)), commit())
    callbacks = [hvd.elastic.UpdateEpochStateCallback(state),
                 hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.CommitStateCallback(state, batches_per_commit=2)]
    rng = np.random.default_rng(hvd.rank())
    x, y = rng.normal(size=(4 * BATCH, 5)), rng.normal(size=(4 * BATCH, 2))

    @hvd.elastic.run
    def train(state: Any) -> None:
        model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                  callbacks=callbacks)

    train(state)                                     # its first sync equalizes the ranks
    committed = _variables(model)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    state.restore()
    restored = _variables(model)
    checks = hvd.allgather_object((
        isinstance(state, ModelState), commits,
        int(np.array(model.optimizer.iterations.numpy())),
        all(a.dtype == b.dtype and a.tobytes() == b.tobytes()
            for a, b in zip(committed, restored))))
    expected = (True, [(0, 2), (0, 4), (1, 0), (1, 2), (1, 4), (2, 0)], 8, True)
    assert checks == [expected] * hvd.size()
    assert_identical_everywhere(restored)
