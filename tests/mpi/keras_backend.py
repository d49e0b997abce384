"""Keras for the multi-rank tests that run on either backend (make test runs them with
TensorFlow and again with KERAS_BACKEND=torch): skip the importing file without Keras,
and give each rank one compute thread on whichever backend runs."""
from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")   # before TensorFlow is imported
import pytest  # noqa: E402

keras = pytest.importorskip("keras")
if keras.backend.backend() == "tensorflow":
    pytest.importorskip("tensorflow").config.threading.set_intra_op_parallelism_threads(1)
else:
    pytest.importorskip("torch").set_num_threads(1)
