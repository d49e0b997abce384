"""``hvdlite.tensorflow.DistributedOptimizer``: Horovod's TensorFlow entry point for
an optimizer. In TensorFlow 2 the optimizers are Keras', and Horovod hands them to
its Keras wrapper; so does this (the Keras code both share, ``hvdlite._keras``), with
Horovod's TensorFlow argument order. TF1's
``tf.compat.v1.train.Optimizer`` (graph-mode sessions) is refused, naming the
TensorFlow 2 ways to train."""
from __future__ import annotations

from typing import Any, Optional

import hvdlite as _hvd
from hvdlite.api.adapter import _describe
from hvdlite.api.compression import Compression, Compressor
from hvdlite.reducer.settings import Groups
from hvdlite.api.process_set import ProcessSet
from hvdlite.errors import HvdliteTypeError


def DistributedOptimizer(optimizer: Any, name: Optional[str] = None, use_locking: bool = False,
                         device_dense: str = "", device_sparse: str = "",
                         compression: type[Compressor] = Compression.none,
                         sparse_as_dense: bool = False, backward_passes_per_step: int = 1,
                         op: int = _hvd.Average, gradient_predivide_factor: float = 1.0,
                         average_aggregated_gradients: bool = False, num_groups: int = 0,
                         groups: Groups = None,
                         process_set: Optional[ProcessSet] = _hvd.global_process_set,
                         scale_local_gradients: bool = True) -> Any:
    """A Keras optimizer whose updates average the gradients across ranks (see
    ``hvdlite.keras.DistributedOptimizer``); ``use_locking`` and ``device_*`` are
    accepted for Horovod."""
    import keras
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise HvdliteTypeError(
            f"hvdlite.tensorflow.DistributedOptimizer wraps a Keras optimizer (tf.keras / "
            f"keras.optimizers.*); got {_describe(optimizer)}. TF1 graph-mode optimizers "
            "(tf.compat.v1.train.*) are not supported: train with a Keras optimizer, or "
            "average the gradients with hvdlite.tensorflow.DistributedGradientTape")
    # The Keras code hvdlite.keras shares (imported on use: Keras is heavy to import).
    from hvdlite._keras.optimizer import DistributedOptimizer as keras_distributed
    from hvdlite.tensorflow import keras_support
    return keras_distributed(optimizer, name, device_dense, device_sparse, compression,
                             sparse_as_dense, gradient_predivide_factor, op,
                             backward_passes_per_step, average_aggregated_gradients,
                             num_groups, groups, process_set, scale_local_gradients,
                             support=keras_support)
