"""``import hvdlite.tensorflow as hvd``: Horovod's TensorFlow 2 API on hvdlite.

Every name of the runtime is here; the collectives take and return TensorFlow
tensors (generated from the TensorFlow adapter, see ``hvdlite.api.binding``),
run eagerly or inside ``tf.function``, and allreduce, allgather and broadcast
are differentiable.
"""
import hvdlite as _hvd
from hvdlite.api.binding import OP_NAMES as _OP_NAMES
from hvdlite.tensorflow.functions import (allgather_object, broadcast_object,
                                          broadcast_variables)
from hvdlite.tensorflow.graph import XlaCompileError
from hvdlite.tensorflow.ops import OPS as _OPS
from hvdlite.tensorflow.tape import DistributedGradientTape
from hvdlite.tensorflow import elastic

globals().update({name: getattr(_hvd, name) for name in _hvd.COMMON_NAMES
                  if name not in ("broadcast_object", "allgather_object")})
globals().update(_OPS)

__all__ = list(_OP_NAMES) + list(_hvd.COMMON_NAMES) + [
    "DistributedGradientTape", "broadcast_variables", "XlaCompileError", "elastic"]
