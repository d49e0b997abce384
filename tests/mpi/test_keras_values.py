"""What Horovod Keras scripts pass to hvdlite.keras (Keras 3 on TensorFlow; make test
also runs this file with KERAS_BACKEND=torch):

- ``broadcast``, ``allreduce``, ``allgather`` and ``reducescatter`` take Python
  scalars, lists and NumPy arrays, as Horovod's Keras API does
  (``hvd.broadcast(resume_from_epoch, 0, name='resume_from_epoch')``), and return a
  tensor of the backend with the dtype ``tf.constant`` gives the value; their
  positional order is Horovod's Keras one (``allreduce(value, name, average, ...)``);
- ``load_model`` on a legacy ``.h5`` file, which names the optimizer 'sgd' or
  'adam' after Keras lowercases it, gives back a DistributedOptimizer.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.mpi.keras_backend import keras

import hvdlite.keras as hvd
from hvdlite.keras.backend import BACKEND
from hvdlite.keras.optimizer import _Distributed


def _check(result: Any, dtype: str, expected: Any) -> None:
    assert keras.ops.is_tensor(result), type(result)   # the backend's own tensor
    assert keras.backend.standardize_dtype(result.dtype) == dtype
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(result), expected)


def test_broadcast_takes_python_and_numpy_values() -> None:
    resume_from_epoch = 3 if hvd.rank() == 0 else 0
    _check(hvd.broadcast(resume_from_epoch, 0, name="resume_from_epoch"), "int32", 3)
    root = hvd.size() - 1
    _check(hvd.broadcast(0.5 * hvd.rank(), root, name="float"), "float32", 0.5 * root)
    _check(hvd.broadcast([hvd.rank(), 1], root), "int32", [root, 1])
    _check(hvd.broadcast(np.full(2, hvd.rank(), np.float64), 0, "array"), "float64", [0, 0])
    _check(hvd.broadcast(hvd.rank() == 0, 0, name="bool"), "bool", True)
    # The backend's own tensors go through as they are; what converts to no tensor is
    # refused on every rank, as before.
    value = keras.ops.convert_to_tensor(np.full(3, hvd.rank(), np.float16))
    _check(hvd.broadcast(value, 0, name="tensor"), "float16", np.zeros(3))
    with pytest.raises(hvd.HvdliteTypeError):
        hvd.broadcast({"epoch": 1}, 0, name="dict")


def test_allreduce_takes_values_in_horovods_keras_argument_order() -> None:
    size, ranks = hvd.size(), np.arange(hvd.size())
    _check(hvd.allreduce(float(hvd.rank()), name="mean"), "float32", ranks.mean())
    _check(hvd.allreduce([1, hvd.rank()], op=hvd.Sum), "int32", [size, ranks.sum()])
    # value, name, average, prescale_factor, postscale_factor, op: Horovod's Keras order
    _check(hvd.allreduce(np.full(2, hvd.rank(), np.float64), "scaled", None, 2.0, 3.0, hvd.Sum),
           "float64", np.full(2, 6.0 * ranks.sum()))
    variable = keras.Variable(np.full(2, hvd.rank() + 1.0, np.float32))
    _check(hvd.allreduce(variable, "variable", op=hvd.Max), "float32", np.full(2, size))


def test_allgather_and_reducescatter_take_values() -> None:
    size = hvd.size()
    _check(hvd.allgather([hvd.rank()] * (hvd.rank() + 1), "ragged"), "int32",
           np.repeat(np.arange(size), np.arange(size) + 1))
    rows = np.arange(2 * size, dtype=np.float64)
    # value, name, op: Horovod's Keras order
    _check(hvd.reducescatter(rows, "rows", hvd.Sum), "float64",
           size * rows[2 * hvd.rank():2 * hvd.rank() + 2])


def test_a_value_inside_tf_function() -> None:
    if BACKEND != "tensorflow":
        pytest.skip("tf.function is the TensorFlow backend's")
    import tensorflow as tf
    traced = tf.function(lambda: hvd.broadcast(7 + hvd.rank(), 0, name="in.graph"))
    _check(traced(), "int32", 7)


@pytest.mark.parametrize("optimizer", ["SGD", "Adam"])
def test_load_model_of_an_h5_file_gives_a_distributed_optimizer(optimizer: str,
                                                                tmp_path: Any) -> None:
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.layers.Input((4,)), keras.layers.Dense(2)])
    # A loss object: Keras 3 cannot read the string "mse" back from an .h5 file.
    model.compile(optimizer=hvd.DistributedOptimizer(getattr(keras.optimizers, optimizer)(0.1)),
                  loss=keras.losses.MeanSquaredError())
    model.fit(np.ones((4 * hvd.size(), 4)), np.ones((4 * hvd.size(), 2)), batch_size=4,
              epochs=1, verbose=0)
    path = str(tmp_path / f"checkpoint-{hvd.rank()}.h5")
    model.save(path)
    loaded = hvd.load_model(path)
    assert isinstance(loaded.optimizer, _Distributed), type(loaded.optimizer).__mro__
    assert type(loaded.optimizer).__name__ == optimizer
    # The class a script's keras.optimizers.SGD(...) has (a torch-specialized one on torch).
    assert isinstance(loaded.optimizer, type(getattr(keras.optimizers, optimizer)(0.1)))
    assert int(loaded.optimizer.iterations) == hvd.size()
    for saved, restored in zip(model.weights, loaded.weights):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(saved),
                                      keras.ops.convert_to_numpy(restored))
    with pytest.raises(hvd.NotSupportedError, match="legacy_opts"):
        hvd.load_model(path, legacy_opts=True)
