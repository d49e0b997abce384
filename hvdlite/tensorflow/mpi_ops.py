"""``horovod.tensorflow.mpi_ops`` for scripts that name it (``hvd.mpi_ops.Sum``,
``from horovod.tensorflow.mpi_ops import allgather``): the runtime's names, the
TensorFlow collectives and the ``*_op`` queries, the same objects as
``hvdlite.tensorflow``'s."""
import hvdlite as _hvd
from hvdlite.api.binding import OP_NAMES as _OP_NAMES
from hvdlite.tensorflow.basics import (_executing_eagerly, local_rank_op,  # noqa: F401
                                       local_size_op, process_set_included_op, rank_op, size_op)
from hvdlite.tensorflow.ops import OPS as _OPS

# broadcast_object and allgather_object are in Horovod's tensorflow.functions, not here.
_RUNTIME = [name for name in _hvd.COMMON_NAMES
            if name not in ("broadcast_object", "allgather_object")]
globals().update({name: getattr(_hvd, name) for name in _RUNTIME})
globals().update(_OPS)

__all__ = list(_OP_NAMES) + _RUNTIME + ["size_op", "local_size_op", "rank_op",
                                        "local_rank_op", "process_set_included_op"]
