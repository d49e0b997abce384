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

globals().update({name: getattr(_hvd, name) for name in _hvd.COMMON_NAMES})
globals().update(_OPS)

__all__ = list(_OP_NAMES) + list(_hvd.COMMON_NAMES) + [
    "DistributedOptimizer", "PartialDistributedOptimizer", "load_model", "callbacks",
    "elastic", "broadcast_variables", "broadcast_global_variables"]
