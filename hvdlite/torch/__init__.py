"""``import hvdlite.torch as hvd``: Horovod's torch API on hvdlite.

Every name of the runtime is here; the collectives take and return torch
tensors (generated from the torch adapter, see ``hvdlite.api.binding``).
"""
import hvdlite as _hvd
from hvdlite.api.binding import OP_NAMES as _OP_NAMES
from hvdlite.torch.functions import (allgather_object, broadcast_object,
                                     broadcast_optimizer_state, broadcast_parameters)
from hvdlite.torch.mpi_ops import (
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
    # the collectives on torch tensors
    allreduce, allreduce_async, allreduce_, allreduce_async_,
    grouped_allreduce, grouped_allreduce_async, grouped_allreduce_, grouped_allreduce_async_,
    allgather, allgather_async, grouped_allgather, grouped_allgather_async,
    broadcast, broadcast_async, broadcast_, broadcast_async_, alltoall, alltoall_async,
    reducescatter, reducescatter_async, grouped_reducescatter, grouped_reducescatter_async,
    synchronize, poll, join, barrier, sparse_allreduce_async)
from hvdlite.torch.optimizer import DistributedOptimizer
from hvdlite.torch.local_sgd import PeriodicModelAverager, PostLocalSGDOptimizer
from hvdlite.torch.zero import ZeroRedundancyOptimizer
from hvdlite.torch import adasum_optimizer as _adasum_optimizer  # noqa: F401  registers op=Adasum
from hvdlite.torch.sync_batch_norm import SyncBatchNorm
from hvdlite.torch import elastic
# Horovod's submodules, which scripts name (hvd.mpi_ops.Sum, horovod.torch.compression).
from hvdlite.torch import compression, mpi_ops  # noqa: F401

__all__ = list(_OP_NAMES) + list(_hvd.COMMON_NAMES) + [
    "DistributedOptimizer", "SyncBatchNorm", "broadcast_parameters",
    "broadcast_optimizer_state", "sparse_allreduce_async", "PeriodicModelAverager",
    "PostLocalSGDOptimizer", "ZeroRedundancyOptimizer"]
