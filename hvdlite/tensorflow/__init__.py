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
from hvdlite.tensorflow.optimizer import DistributedOptimizer
from hvdlite.tensorflow.tape import DistributedGradientTape, PartialDistributedGradientTape
from hvdlite.tensorflow import elastic
# Horovod's submodules, which scripts name (hvd.mpi_ops.Sum, horovod.tensorflow.compression,
# hvd.util._executing_eagerly).
from hvdlite.tensorflow import compression, mpi_ops, util  # noqa: F401

from hvdlite.tensorflow.mpi_ops import (
    # the runtime
    init, shutdown, is_initialized, rank, size, local_rank, local_size, cross_rank, cross_size,
    is_homogeneous, local_device, mpi_threads_supported,
    ProcessSet, global_process_set, add_process_set, remove_process_set,
    start_timeline, stop_timeline, traffic, step_done,
    mpi_built, mpi_enabled, nccl_built, gloo_built, gloo_enabled, ccl_built, cuda_built,
    rocm_built, ddl_built,
    ReduceOp, Average, Sum, Adasum, Min, Max, Product, Compression, GroupHandle,
    HvdliteError, UsageError, HvdliteTypeError, NotInitializedError, NotSupportedError,
    DuplicateNameError, ConfigError, MismatchError, DeadlockError, JoinError, StallError,
    ShutdownError, PeerLostError, CollectiveFailedError, HostsUpdatedError, StateError,
    HorovodInternalError, HostsUpdatedInterrupt, OutputPathError,
    # the collectives on TensorFlow tensors
    allreduce, allreduce_async, allreduce_, allreduce_async_,
    grouped_allreduce, grouped_allreduce_async, grouped_allreduce_, grouped_allreduce_async_,
    allgather, allgather_async, grouped_allgather, grouped_allgather_async,
    broadcast, broadcast_async, broadcast_, broadcast_async_, alltoall, alltoall_async,
    reducescatter, reducescatter_async, grouped_reducescatter, grouped_reducescatter_async,
    synchronize, poll, join, barrier)


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
