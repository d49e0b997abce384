"""``import hvdlite.torch as hvd``: Horovod's torch API on hvdlite.

Every name of the runtime is here; the collectives take and return torch
tensors (generated from the torch adapter, see ``hvdlite.api.binding``).
"""
import hvdlite as _hvd
from hvdlite.api.binding import OP_NAMES as _OP_NAMES
from hvdlite.torch.functions import (allgather_object, broadcast_object,
                                     broadcast_optimizer_state, broadcast_parameters)
from hvdlite.torch.ops import OPS as _OPS
from hvdlite.torch.optimizer import DistributedOptimizer
from hvdlite.torch import adasum_optimizer as _adasum_optimizer  # noqa: F401  registers op=Adasum
from hvdlite.torch.sync_batch_norm import SyncBatchNorm
from hvdlite.torch import elastic
# Horovod's submodules, which scripts name (hvd.mpi_ops.Sum, horovod.torch.compression).
from hvdlite.torch import compression, mpi_ops  # noqa: F401

globals().update({name: getattr(_hvd, name) for name in _hvd.COMMON_NAMES
                  if name not in ("broadcast_object", "allgather_object")})
globals().update(_OPS)

__all__ = list(_OP_NAMES) + list(_hvd.COMMON_NAMES) + [
    "DistributedOptimizer", "SyncBatchNorm", "broadcast_parameters",
    "broadcast_optimizer_state", "sparse_allreduce_async"]
