"""The op set generated from the TensorFlow adapter (``hvdlite.api.binding``),
shared by the modules that extend it (``ops``, ``scatter``), and the small
process-set helpers they all need."""
from __future__ import annotations

from typing import Any, Optional

import hvdlite as _hvd
from hvdlite.api.binding import make_ops
from hvdlite.api.process_set import ProcessSet
from hvdlite.tensorflow.adapter import TENSORFLOW

GENERATED = make_ops(TENSORFLOW)
PS = Optional[ProcessSet]


def member_rank(process_set: PS) -> int:
    if process_set is None or process_set is _hvd.global_process_set:
        return _hvd.rank()
    return process_set.rank()


def set_size(process_set: PS) -> int:
    return _hvd.size() if process_set is None else process_set.size()


def refuse(op: str, tensor: Any, *args: Any) -> Any:
    """Not a TensorFlow tensor: the generated op raises, and tells the peers."""
    return GENERATED[op](tensor, *args)
