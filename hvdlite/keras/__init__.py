"""``import hvdlite.keras as hvd``: Horovod's Keras API on hvdlite, for Keras 3
on the TensorFlow backend (collectives on tf tensors, also inside model.fit's
compiled train step) and on the torch backend (``KERAS_BACKEND=torch``).
Other backends are refused at import, naming the supported ones.
``allreduce``, ``allgather``, ``broadcast`` and ``reducescatter`` take any
tensor-compatible value, as Horovod's Keras API does (see ``collectives``).
"""
import hvdlite as _hvd
from hvdlite.api.binding import OP_NAMES as _OP_NAMES
from hvdlite.keras import callbacks, elastic
from hvdlite.keras.collectives import OPS as _OPS
from hvdlite.keras.optimizer import (DistributedOptimizer, PartialDistributedOptimizer,
                                     load_model)
from hvdlite.keras.variables import broadcast_global_variables, broadcast_variables

from hvdlite import (  # the runtime (hvdlite.COMMON_NAMES)
    init, shutdown, is_initialized, rank, size, local_rank, local_size, cross_rank, cross_size,
    is_homogeneous, local_device, mpi_threads_supported,
    ProcessSet, global_process_set, add_process_set, remove_process_set,
    broadcast_object, allgather_object, start_timeline, stop_timeline, traffic, step_done,
    mpi_built, mpi_enabled, nccl_built, gloo_built, gloo_enabled, ccl_built, cuda_built,
    rocm_built, ddl_built,
    ReduceOp, Average, Sum, Adasum, Min, Max, Product, Compression, GroupHandle,
    HvdliteError, UsageError, HvdliteTypeError, NotInitializedError, NotSupportedError,
    DuplicateNameError, ConfigError, MismatchError, DeadlockError, JoinError, StallError,
    ShutdownError, PeerLostError, CollectiveFailedError, HostsUpdatedError, StateError,
    HorovodInternalError, HostsUpdatedInterrupt, OutputPathError)

# The collectives on the Keras backend's tensors, one name per op of the factory's set.
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

__all__ = list(_OP_NAMES) + list(_hvd.COMMON_NAMES) + [
    "DistributedOptimizer", "PartialDistributedOptimizer", "load_model", "callbacks",
    "elastic", "broadcast_variables", "broadcast_global_variables"]
