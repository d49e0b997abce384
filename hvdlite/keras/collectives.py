"""Horovod's Keras collectives: ``allreduce``, ``allgather``, ``broadcast`` and
``reducescatter`` on any tensor-compatible value, with Horovod's Keras signatures.

Horovod's Keras API converts its argument (``tf.constant(value)``) and returns a
tensor, so scripts pass Python scalars, lists and NumPy arrays, as in
``resume_from_epoch = hvd.broadcast(resume_from_epoch, 0, name="resume_from_epoch")``.
Here a value is converted with ``keras.ops.convert_to_tensor``, which gives the
same dtypes as ``tf.constant`` (an int is int32, a float float32, a NumPy array
keeps its dtype), and the result is a tensor of the Keras backend (a
``tf.Tensor``, or a ``torch.Tensor`` with ``KERAS_BACKEND=torch``). The backend's
own tensors and variables go to the binding's collectives as they are, so these
keep working inside ``tf.function`` and stay differentiable.

The positional order is Horovod's Keras one, which differs from the TensorFlow
binding's: ``allreduce(value, name, average, ...)`` and ``reducescatter(value,
name, op)``. ``process_set`` is hvdlite's addition, by keyword only.
"""
from __future__ import annotations

from typing import Any, Optional

import keras

from hvdlite.api.compression import Compression, Compressor
from hvdlite.api.process_set import ProcessSet
from hvdlite.keras.backend import ADAPTER, OPS as BACKEND_OPS, SUPPORT
from hvdlite.reduce_op import ReduceOp

PS = Optional[ProcessSet]


def _tensor(value: Any) -> Any:
    """``value`` as a tensor of the backend; the backend's tensors (and, on
    TensorFlow, tf.IndexedSlices) unchanged. A value that does not convert is
    returned as it is: the binding's collective then refuses it with its usual
    HvdliteTypeError, which also reaches the other ranks, so none of them waits."""
    if ADAPTER.is_tensor(value) or type(value).__name__ == "IndexedSlices":
        return value
    try:
        return keras.ops.convert_to_tensor(value)
    except (TypeError, ValueError):
        return value


@SUPPORT.entry_point
def allreduce(value: Any, name: Optional[str] = None, average: Optional[bool] = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              op: Optional[int] = None, compression: Optional[type[Compressor]] = Compression.none,
              *, process_set: PS = None) -> Any:
    """Reduce a tensor-compatible value across ranks (default op: Average)."""
    return BACKEND_OPS["allreduce"](
        _tensor(value), average=average, name=name, compression=compression, op=op,
        prescale_factor=prescale_factor, postscale_factor=postscale_factor,
        process_set=process_set)


@SUPPORT.entry_point
def allgather(value: Any, name: Optional[str] = None, *, process_set: PS = None) -> Any:
    """Concatenate every rank's value along the first dimension (which may differ)."""
    return BACKEND_OPS["allgather"](_tensor(value), name=name, process_set=process_set)


@SUPPORT.entry_point
def broadcast(value: Any, root_rank: int, name: Optional[str] = None, *,
              process_set: PS = None) -> Any:
    """Every rank receives ``root_rank``'s value."""
    return BACKEND_OPS["broadcast"](_tensor(value), root_rank, name=name,
                                    process_set=process_set)


@SUPPORT.entry_point
def reducescatter(value: Any, name: Optional[str] = None, op: int = ReduceOp.AVERAGE, *,
                  process_set: PS = None) -> Any:
    """Reduce across ranks; rank i keeps the i-th block of rows."""
    return BACKEND_OPS["reducescatter"](_tensor(value), name=name, op=op,
                                        process_set=process_set)


# hvdlite.keras's op set: the backend binding's, with these four in Horovod's Keras form.
OPS: dict[str, Any] = dict(BACKEND_OPS, allreduce=allreduce, allgather=allgather,
                           broadcast=broadcast, reducescatter=reducescatter)
