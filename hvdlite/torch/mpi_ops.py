"""``horovod.torch.mpi_ops`` for scripts that name it (``hvd.mpi_ops.Sum``,
``from horovod.torch.mpi_ops import allreduce_async``): the runtime's names and
the torch collectives, the same objects as ``hvdlite.torch``'s."""
import hvdlite as _hvd
from hvdlite.api.binding import OP_NAMES as _OP_NAMES
from hvdlite.torch.ops import OPS as _OPS

# broadcast_object and allgather_object are in Horovod's torch.functions, not here.
_RUNTIME = [name for name in _hvd.COMMON_NAMES
            if name not in ("broadcast_object", "allgather_object")]
globals().update({name: getattr(_hvd, name) for name in _RUNTIME})
globals().update(_OPS)

__all__ = list(_OP_NAMES) + _RUNTIME + ["sparse_allreduce_async"]
