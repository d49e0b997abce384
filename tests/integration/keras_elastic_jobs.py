"""The Keras elastic training program of the restart test (run under hvdliterun
--elastic): a small deterministic model trained with model.fit, KerasState and
the elastic callbacks, resuming mid-epoch from the committed batch.

Environment (test settings, not hvdlite knobs):
  ELASTIC_OUT       rank 0 writes the final model and optimizer variables here (JSON)
  ELASTIC_FAULT     kill_after_commit: rank 1 SIGKILLs itself right after commit N
  ELASTIC_FAULT_AT  N (default 5)
  ELASTIC_MARKER    a file created when the fault fires, so it fires in one attempt only
"""
from __future__ import annotations

import json
import os
import signal
import sys
from typing import Any, Optional

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import hvdlite.keras as hvd  # noqa: E402

EPOCHS = 3
SAMPLES = 48
BATCH = 4              # per rank
BATCHES_PER_COMMIT = 2


class _KillAfterCommit(keras.callbacks.Callback):
    """After CommitStateCallback: rank 1 dies right after commit N (once per job)."""

    def __init__(self, state: hvd.elastic.KerasState) -> None:
        super().__init__()
        self.state = state

    def on_train_batch_end(self, batch: int, logs: Optional[dict] = None) -> None:
        marker = os.environ.get("ELASTIC_MARKER", "")
        if (os.environ.get("ELASTIC_FAULT") != "kill_after_commit" or hvd.rank() != 1
                or self.state._commits != int(os.environ.get("ELASTIC_FAULT_AT", "5"))
                or (marker and os.path.exists(marker))):
            return
        if marker:
            with open(marker, "w") as handle:
                handle.write("fired\n")
        os.kill(os.getpid(), signal.SIGKILL)


def _data() -> tuple[np.ndarray, np.ndarray]:
    """This rank's rows, in the same order in every run (no shuffling)."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(SAMPLES, 6)).astype("float32")
    y = (x @ np.arange(1.0, 7.0, dtype="float32")[:, None] + 0.5).astype("float32")
    return x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()]


@hvd.elastic.run
def _train(state: hvd.elastic.KerasState, x: np.ndarray, y: np.ndarray,
           callbacks: list[Any]) -> None:
    if hvd.rank() == 0:
        print(f"START commits={state._commits} epoch={state.epoch} batch={state.batch}",
              flush=True)
    skip = state.batch * BATCH
    if skip:            # finish the epoch a restart interrupted, from the committed batch
        state.model.fit(x[skip:], y[skip:], batch_size=BATCH, epochs=1, shuffle=False,
                        verbose=0, callbacks=callbacks)
    if state.epoch < EPOCHS:
        state.model.fit(x, y, batch_size=BATCH, epochs=EPOCHS - state.epoch, shuffle=False,
                        verbose=0, callbacks=callbacks)


def train() -> None:
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    hvd.init()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.layers.Input((6,)), keras.layers.Dense(5, activation="tanh"),
                              keras.layers.Dense(1)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01, momentum=0.9)),
                  loss="mse")
    state = hvd.elastic.KerasState(model, epoch=0, batch=0)
    callbacks = [hvd.elastic.UpdateEpochStateCallback(state),
                 hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.CommitStateCallback(state, batches_per_commit=BATCHES_PER_COMMIT),
                 _KillAfterCommit(state)]
    x, y = _data()
    _train(state, x, y, callbacks)
    if hvd.rank() == 0:
        variables = model.variables + model.optimizer.variables
        with open(os.environ["ELASTIC_OUT"], "w") as handle:
            json.dump({"variables": [np.array(v.numpy()).tobytes().hex() for v in variables],
                       "iterations": int(model.optimizer.iterations.numpy()),
                       "epoch": state.epoch}, handle)
    print(f"DONE rank {hvd.rank()}", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    globals()[sys.argv[1]]()
