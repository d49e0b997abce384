"""``import hvdlite.torch as hvd``: Horovod's torch API on hvdlite.

The runtime's functions (init, rank, size, barrier, process sets, ...) are
re-exported unchanged; collectives here take and return torch tensors.
"""
from hvdlite import (Average, Max, Min, Product, ProcessSet, ReduceOp, Sum, add_process_set,
                     barrier, ccl_built, cross_rank, cross_size, cuda_built, gloo_built,
                     global_process_set, init, is_homogeneous, is_initialized, local_device,
                     local_rank,
                     local_size, mpi_built, mpi_enabled, mpi_threads_supported, nccl_built,
                     rank, remove_process_set, shutdown, size, start_timeline, stop_timeline)
from hvdlite.errors import (DuplicateNameError, HvdliteError, JoinError, MismatchError,
                            NotInitializedError, ShutdownError, StallError)
from hvdlite.torch.compression import Compression
from hvdlite.torch.functions import (allgather_object, broadcast_object,
                                     broadcast_optimizer_state, broadcast_parameters)
from hvdlite.torch.ops import (allgather, allgather_async, allreduce, allreduce_,
                               allreduce_async, allreduce_async_, alltoall, alltoall_async,
                               broadcast, broadcast_, broadcast_async, broadcast_async_,
                               grouped_allreduce, grouped_allreduce_, grouped_allreduce_async,
                               grouped_allreduce_async_, join, poll, reducescatter,
                               reducescatter_async, synchronize)
from hvdlite.torch.optimizer import DistributedOptimizer
from hvdlite.torch.sync_batch_norm import SyncBatchNorm

__all__ = [name for name in dir() if not name.startswith("_")]
