"""``horovod.tensorflow.mpi_ops`` for scripts that name it (``hvd.mpi_ops.Sum``,
``from horovod.tensorflow.mpi_ops import allgather``): the runtime's names, the
TensorFlow collectives and the ``*_op`` queries, the same objects as
``hvdlite.tensorflow``'s, which imports them from here."""
import hvdlite as _hvd
from hvdlite.api.binding import OP_NAMES as _OP_NAMES
# The runtime: hvdlite.COMMON_NAMES but broadcast_object and allgather_object, which are
# in Horovod's tensorflow.functions.
from hvdlite import (init, shutdown, is_initialized, rank, size, local_rank, local_size,
                     cross_rank, cross_size, is_homogeneous, local_device, mpi_threads_supported,
                     ProcessSet, global_process_set, add_process_set, remove_process_set,
                     start_timeline, stop_timeline, traffic, step_done,
                     mpi_built, mpi_enabled, nccl_built, gloo_built, gloo_enabled, ccl_built,
                     cuda_built, rocm_built, ddl_built,
                     ReduceOp, Average, Sum, Adasum, Min, Max, Product, Compression, GroupHandle,
                     HvdliteError, UsageError, HvdliteTypeError, NotInitializedError,
                     NotSupportedError, DuplicateNameError, ConfigError, MismatchError,
                     DeadlockError, JoinError, StallError, ShutdownError, PeerLostError,
                     CollectiveFailedError, HostsUpdatedError, StateError, HorovodInternalError,
                     HostsUpdatedInterrupt, OutputPathError)
from hvdlite.tensorflow.basics import (_executing_eagerly, local_rank_op,  # noqa: F401
                                       local_size_op, process_set_included_op, rank_op, size_op)
from hvdlite.tensorflow.ops import OPS as _OPS

# The TensorFlow op set (the factory's, differentiable and usable in tf.function), one
# name per op.
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

_RUNTIME = [name for name in _hvd.COMMON_NAMES
            if name not in ("broadcast_object", "allgather_object")]
__all__ = list(_OP_NAMES) + _RUNTIME + ["size_op", "local_size_op", "rank_op",
                                        "local_rank_op", "process_set_included_op"]
