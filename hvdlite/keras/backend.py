"""What differs between the Keras backends hvdlite.keras supports: the tensor
binding whose collectives its API exposes (``OPS``; ``ADAPTER`` says which objects
are the backend's tensors), and the binding's support for the shared Keras
optimizer (``SUPPORT``: how a gradient list is reduced, how ``apply`` is entered,
how a step is marked; see ``hvdlite._keras.optimizer``). Any other backend is
refused here, at import."""
from __future__ import annotations

import keras

SUPPORTED = ("tensorflow", "torch")
BACKEND = keras.backend.backend()


class UnsupportedBackendError(ImportError):
    """hvdlite.keras was imported with a Keras backend it does not support."""


if BACKEND not in SUPPORTED:
    raise UnsupportedBackendError(
        f"hvdlite.keras supports the Keras backends {' and '.join(SUPPORTED)}; this Keras "
        f"runs on '{BACKEND}'. Set KERAS_BACKEND=tensorflow or KERAS_BACKEND=torch before "
        "importing keras (for JAX, hvdlite has no binding yet).")

if BACKEND == "tensorflow":
    from hvdlite.tensorflow import keras_support as SUPPORT
    from hvdlite.tensorflow.adapter import TENSORFLOW as ADAPTER
    from hvdlite.tensorflow.ops import OPS
else:
    from hvdlite.keras import torch_reduce as SUPPORT
    from hvdlite.torch.adapter import TORCH as ADAPTER
    from hvdlite.torch.ops import OPS

__all__ = ["ADAPTER", "BACKEND", "OPS", "SUPPORT", "UnsupportedBackendError"]
