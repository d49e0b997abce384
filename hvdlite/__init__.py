"""hvdlite: Horovod-style data-parallel training on mpi4py and NumPy.

``import hvdlite as hvd`` gives the runtime on NumPy arrays; the framework
bindings (``hvdlite.torch``...) re-export all of it. Importing has no side
effects: nothing starts before ``hvd.init()``.
"""
from hvdlite.core.objects import (allgather_object, broadcast_object, ccl_built, cuda_built,
                                  gloo_built, mpi_built, mpi_enabled, nccl_built,
                                  start_timeline, stop_timeline)
from hvdlite.core.ops import (Average, GroupHandle, Max, Min, Product, Sum, add_process_set,
                              allgather, allgather_async, allreduce, allreduce_,
                              allreduce_async, allreduce_async_, alltoall, alltoall_async,
                              barrier, broadcast, broadcast_, broadcast_async,
                              broadcast_async_, grouped_allgather, grouped_allreduce,
                              grouped_allreduce_, grouped_allreduce_async,
                              grouped_allreduce_async_, grouped_reducescatter, join, poll,
                              reducescatter, reducescatter_async, remove_process_set,
                              synchronize)
from hvdlite.core.process_sets import ProcessSet
from hvdlite.core.state import (cross_rank, cross_size, global_process_set, init,
                                is_homogeneous, is_initialized, local_device, local_rank,
                                local_size,
                                mpi_threads_supported, rank, shutdown, size)
from hvdlite.errors import (DuplicateNameError, HvdliteError, JoinError, MismatchError,
                            NotInitializedError, PeerLostError, ShutdownError, StallError)
from hvdlite.reduce_op import ReduceOp

__version__ = "0.1.0"

__all__ = [name for name in dir() if not name.startswith("_")]
