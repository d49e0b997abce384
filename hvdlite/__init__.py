"""hvdlite: Horovod-style data-parallel training on mpi4py and NumPy.

``import hvdlite as hvd`` gives the runtime on NumPy arrays; the framework
bindings (``hvdlite.torch``...) export the same names on their own tensors.
Importing has no side effects: mpi4py, and with it MPI, is loaded by
``hvd.init()``, never at import.
"""
from hvdlite.api.adapter import NUMPY as _NUMPY
from hvdlite.api.binding import OP_NAMES as _OP_NAMES, make_ops as _make_ops
from hvdlite.api.compression import Compression
from hvdlite.api.control import add_process_set, init, remove_process_set
from hvdlite.api.objects import (allgather_object, broadcast_object, ccl_built, cuda_built,
                                 ddl_built, gloo_built, gloo_enabled, mpi_built, mpi_enabled,
                                 nccl_built, rocm_built, start_timeline, stop_timeline)
from hvdlite.api.process_set import ProcessSet, global_process_set
from hvdlite.api.runtime import (cross_rank, cross_size, is_homogeneous, is_initialized,
                                 local_device, local_rank, local_size, mpi_threads_supported, rank,
                                 shutdown, size, step_done)
from hvdlite.api.submission import GroupHandle
from hvdlite.diagnostics import autotune as _autotune   # noqa: F401  HVDLITE_AUTOTUNE's start hook
from hvdlite.diagnostics.report import traffic
from hvdlite.errors import (CollectiveFailedError, ConfigError, DeadlockError, DuplicateNameError,
                            HorovodInternalError, HostsUpdatedError, HostsUpdatedInterrupt,
                            HvdliteError, HvdliteTypeError, JoinError, MismatchError,
                            NotInitializedError, NotSupportedError, OutputPathError, PeerLostError,
                            ShutdownError, StallError, StateError, UsageError)
from hvdlite.reduce_op import ReduceOp

__version__ = "0.1.0"

Average, Sum, Min, Max, Product = (ReduceOp.AVERAGE, ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX,
                                   ReduceOp.PRODUCT)
Adasum = ReduceOp.ADASUM

# The collectives on NumPy arrays, one name per op of the factory's set (OP_NAMES;
# tests/unit/test_binding_names.py checks that none is left out).
_OPS = _make_ops(_NUMPY)
allreduce = _OPS["allreduce"]
allreduce_async = _OPS["allreduce_async"]
allreduce_ = _OPS["allreduce_"]
allreduce_async_ = _OPS["allreduce_async_"]
grouped_allreduce = _OPS["grouped_allreduce"]
grouped_allreduce_async = _OPS["grouped_allreduce_async"]
grouped_allreduce_ = _OPS["grouped_allreduce_"]
grouped_allreduce_async_ = _OPS["grouped_allreduce_async_"]
allgather = _OPS["allgather"]
allgather_async = _OPS["allgather_async"]
grouped_allgather = _OPS["grouped_allgather"]
grouped_allgather_async = _OPS["grouped_allgather_async"]
broadcast = _OPS["broadcast"]
broadcast_async = _OPS["broadcast_async"]
broadcast_ = _OPS["broadcast_"]
broadcast_async_ = _OPS["broadcast_async_"]
alltoall = _OPS["alltoall"]
alltoall_async = _OPS["alltoall_async"]
reducescatter = _OPS["reducescatter"]
reducescatter_async = _OPS["reducescatter_async"]
grouped_reducescatter = _OPS["grouped_reducescatter"]
grouped_reducescatter_async = _OPS["grouped_reducescatter_async"]
synchronize = _OPS["synchronize"]
poll = _OPS["poll"]
join = _OPS["join"]
barrier = _OPS["barrier"]

# Shared by every binding: a binding's __all__ is its op set plus these names.
COMMON_NAMES = (
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "is_homogeneous", "local_device", "mpi_threads_supported",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "broadcast_object", "allgather_object", "start_timeline", "stop_timeline", "traffic",
    "step_done",
    "mpi_built", "mpi_enabled", "nccl_built", "gloo_built", "gloo_enabled", "ccl_built",
    "cuda_built", "rocm_built", "ddl_built",
    "ReduceOp", "Average", "Sum", "Adasum", "Min", "Max", "Product", "Compression", "GroupHandle",
    "HvdliteError", "UsageError", "HvdliteTypeError", "NotInitializedError", "NotSupportedError",
    "DuplicateNameError", "ConfigError", "MismatchError", "DeadlockError", "JoinError",
    "StallError", "ShutdownError", "PeerLostError", "CollectiveFailedError", "HostsUpdatedError",
    "StateError", "HorovodInternalError", "HostsUpdatedInterrupt", "OutputPathError",
)

# Not in __all__ (the bindings have their own elastic module, and no run):
from hvdlite import elastic                       # noqa: E402  NumPy-level State, run
from hvdlite.runner.function import run           # noqa: E402  Horovod's horovod.run

__all__ = list(_OP_NAMES) + list(COMMON_NAMES) + ["COMMON_NAMES", "__version__"]
