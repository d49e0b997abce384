"""Horovod's submodules that scripts name: ``hvd.mpi_ops.Sum`` and ``from
horovod.<framework>.mpi_ops import ...``, ``horovod.<framework>.compression``
(torch and TensorFlow, where Horovod has them), and ``hvdlite.keras.callbacks``
imported as a module. They hold the binding's own objects, and work."""
from __future__ import annotations

import importlib

import numpy as np
import pytest

import hvdlite as hvd

FRAMEWORKS = {"hvdlite.torch": "torch", "hvdlite.tensorflow": "tensorflow"}


@pytest.mark.parametrize("binding", sorted(FRAMEWORKS))
def test_mpi_ops_is_a_submodule_with_the_bindings_objects(binding: str) -> None:
    framework = pytest.importorskip(FRAMEWORKS[binding])
    package = importlib.import_module(binding)
    mpi_ops = importlib.import_module(f"{binding}.mpi_ops")
    assert package.mpi_ops is mpi_ops
    assert (mpi_ops.Sum, mpi_ops.Average, mpi_ops.Adasum) == (hvd.Sum, hvd.Average, hvd.Adasum)
    for name in mpi_ops.__all__:
        assert getattr(mpi_ops, name) is getattr(package, name), name
    assert mpi_ops.rank() == hvd.rank() and mpi_ops.size() == hvd.size()
    value = (framework.ones(3) if FRAMEWORKS[binding] == "torch"
             else framework.ones(3, dtype=framework.float64))
    total = mpi_ops.allreduce(value * (hvd.rank() + 1), op=mpi_ops.Sum, name=f"{binding}.mpi_ops")
    expected = hvd.size() * (hvd.size() + 1) / 2
    np.testing.assert_array_equal(np.asarray(total), np.full(3, expected))


@pytest.mark.parametrize("binding", sorted(FRAMEWORKS))
def test_compression_is_a_submodule_with_horovods_classes(binding: str) -> None:
    pytest.importorskip(FRAMEWORKS[binding])
    package = importlib.import_module(binding)
    compression = importlib.import_module(f"{binding}.compression")
    assert package.compression is compression
    assert compression.Compression is package.Compression is hvd.Compression
    assert compression.Compression.none is compression.NoneCompressor
    assert compression.Compression.fp16 is compression.FP16Compressor
    assert issubclass(compression.FP16Compressor, compression.Compressor)


def test_the_imports_of_a_horovod_keras_script() -> None:
    """``import horovod.tensorflow.keras as hvd`` scripts also import these by name."""
    pytest.importorskip("keras")
    import hvdlite.keras as hvd_keras
    import hvdlite.keras.callbacks as callbacks
    from hvdlite.tensorflow.compression import Compression
    from hvdlite.tensorflow.mpi_ops import Sum
    assert hvd_keras.callbacks is callbacks and callbacks.BroadcastGlobalVariablesCallback
    assert (Compression, Sum) == (hvd_keras.Compression, hvd_keras.Sum)


def test_tensorflow_util_names_executing_eagerly() -> None:
    """Horovod's own TensorFlow tests (and some scripts) call ``hvd.util._executing_eagerly()``."""
    tf = pytest.importorskip("tensorflow")
    import hvdlite.tensorflow as hvd_tf
    util = importlib.import_module("hvdlite.tensorflow.util")
    assert hvd_tf.util is util and util._executing_eagerly() is True
    with tf.Graph().as_default():
        assert util._executing_eagerly() is False
