"""``import hvdlite.tensorflow as hvd``: Horovod's TensorFlow 2 API on hvdlite.

Every name of the runtime is here; the collectives take and return TensorFlow
tensors (generated from the TensorFlow adapter, see ``hvdlite.api.binding``),
run eagerly or inside ``tf.function``, and allreduce, allgather and broadcast
are differentiable. Errors are hvdlite's and TensorFlow's at once (see
``hvdlite.tensorflow.errors``). ``SyncBatchNormalization`` is a Keras layer,
loaded (with Keras) on first use.
"""
from typing import Any

import hvdlite as _hvd
from hvdlite.api.binding import OP_NAMES as _OP_NAMES
from hvdlite.tensorflow.basics import (BroadcastGlobalVariablesHook, _executing_eagerly,
                                       broadcast_global_variables, local_rank_op,
                                       local_size_op, process_set_included_op, rank_op,
                                       size_op)
from hvdlite.tensorflow.functions import (allgather_object, broadcast_object,
                                          broadcast_object_fn, broadcast_variables)
from hvdlite.tensorflow.graph import XlaCompileError
from hvdlite.tensorflow.ops import OPS as _OPS
from hvdlite.tensorflow.optimizer import DistributedOptimizer
from hvdlite.tensorflow.tape import DistributedGradientTape, PartialDistributedGradientTape
from hvdlite.tensorflow import elastic
# Horovod's submodules, which scripts name (hvd.mpi_ops.Sum, horovod.tensorflow.compression,
# hvd.util._executing_eagerly).
from hvdlite.tensorflow import compression, mpi_ops, util  # noqa: F401

globals().update({name: getattr(_hvd, name) for name in _hvd.COMMON_NAMES
                  if name not in ("broadcast_object", "allgather_object")})
globals().update(_OPS)


def __getattr__(name: str) -> Any:
    if name == "SyncBatchNormalization":
        from hvdlite.tensorflow.sync_batch_norm import SyncBatchNormalization
        return SyncBatchNormalization
    raise AttributeError(f"module 'hvdlite.tensorflow' has no attribute '{name}'")


__all__ = list(_OP_NAMES) + list(_hvd.COMMON_NAMES) + [
    "DistributedGradientTape", "PartialDistributedGradientTape", "DistributedOptimizer",
    "SyncBatchNormalization", "broadcast_variables", "broadcast_global_variables",
    "BroadcastGlobalVariablesHook", "broadcast_object_fn",
    "size_op", "local_size_op", "rank_op", "local_rank_op", "process_set_included_op",
    "XlaCompileError", "elastic"]
