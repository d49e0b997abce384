"""hvdlite.keras with Keras 3 on the torch backend (make test runs this file with
KERAS_BACKEND=torch; in a TensorFlow-backend run it skips): model.fit on N ranks,
each with 1/N of every batch, reaches the weights of one process on the whole
batch, bitwise identical across ranks. The JAX backend is refused at import."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import numpy as np
import pytest

keras = pytest.importorskip(
    "keras", reason="Keras is not installed in this venv (make test's Open MPI venv, .venv-ompi, "
    "has NumPy and torch only)")
if keras.backend.backend() != "torch":
    pytest.skip("run with KERAS_BACKEND=torch (make test does)", allow_module_level=True)
torch = pytest.importorskip("torch")
torch.set_num_threads(1)

import hvdlite.keras as hvd  # noqa: E402

PER_RANK = 4
# Looser than the TensorFlow backend's 1e-10: Keras 3.15's torch backend yields float64
# gradients with float32-sized rounding differences between batch splits (measured in
# one process, no hvdlite involved: up to 6e-8 between a batch of 8 and the mean of its
# two halves), so the N-rank and one-process runs drift apart by ~1e-8 over the steps.
TOLERANCE = 1e-6
STEPS = 5


def _model(seed: int = 1234) -> "keras.Model":
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.layers.Input((5,), dtype="float64"),
                             keras.layers.Dense(8, activation="tanh", dtype="float64"),
                             keras.layers.Dense(3, dtype="float64")])


def _data(batches: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    rows = batches * PER_RANK * hvd.size()
    return rng.normal(size=(rows, 5)), rng.normal(size=(rows, 3))


def _shard(array: np.ndarray) -> np.ndarray:
    blocks = array.reshape(-1, hvd.size(), PER_RANK, array.shape[-1])
    return blocks[:, hvd.rank()].reshape(-1, array.shape[-1])


def _fit(make_opt, distributed: bool, passes: int = 1, seed: int = 1234,  # type: ignore[no-untyped-def]
         callbacks: list = (), **wrap) -> "keras.Model":
    model = _model(seed)
    optimizer = make_opt()
    if distributed:
        optimizer = hvd.DistributedOptimizer(optimizer, backward_passes_per_step=passes, **wrap)
    model.compile(optimizer=optimizer, loss=keras.losses.MeanSquaredError(dtype="float64"))
    x, y = _data(STEPS * passes)
    if distributed:
        x, y, batch = _shard(x), _shard(y), PER_RANK
    else:
        batch = PER_RANK * hvd.size() * passes
    model.fit(x, y, batch_size=batch, epochs=2, shuffle=False, verbose=0,
              callbacks=list(callbacks))
    return model


def _check(got: "keras.Model", want: "keras.Model") -> None:
    for a, b in zip(got.get_weights(), want.get_weights()):
        np.testing.assert_allclose(a, b, rtol=0, atol=TOLERANCE)
    digest = hashlib.sha256(b"".join(w.tobytes() for w in got.get_weights())).hexdigest()
    assert len(set(hvd.allgather_object(digest))) == 1


OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(0.01),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_fit_on_torch_backend_matches_one_process(name: str) -> None:
    _check(_fit(OPTIMIZERS[name], True), _fit(OPTIMIZERS[name], False))


def test_backward_passes_per_step_on_torch_backend() -> None:
    make = OPTIMIZERS["sgd"]
    _check(_fit(make, True, passes=2, average_aggregated_gradients=True),
           _fit(make, False, passes=2))


def test_broadcast_callback_on_torch_backend() -> None:
    got = _fit(OPTIMIZERS["sgd"], True, seed=50 + hvd.rank(),
               callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    _check(got, _fit(OPTIMIZERS["sgd"], False, seed=50))


def test_jax_backend_is_refused_at_import() -> None:
    if hvd.rank() != 0:
        return
    # JAX is not installed here: make Keras report it as its backend instead.
    code = ("import keras\nkeras.backend.backend = lambda: 'jax'\n"
            "try:\n    import hvdlite.keras\nexcept ImportError as e:\n    print('refused:', e)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI", "MPI", "HYDRA"))}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=120)
    assert "refused:" in out.stdout and "tensorflow and torch" in out.stdout, out.stderr[-2000:]
