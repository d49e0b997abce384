"""alltoall, reducescatter and grouped_reducescatter on TensorFlow tensors, eager
or inside ``tf.function``, differentiable with Horovod's conventions (those of
the torch binding too):

- alltoall: the gradient is the alltoall of the gradient back along the
  received splits (each received row's gradient returns to the rank it came
  from, in the order that rank sent it);
- reducescatter: the gradient is the allgather of the gradient, multiplied by
  the set size for op=Sum and left unscaled for op=Average (then the prescale
  and postscale factors): the size times the gradient of the sum of every
  rank's loss, the same convention as allreduce's gradient. Other ops have no
  gradient (UsageError when one is asked for).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np
import tensorflow as tf

import hvdlite as _hvd
from hvdlite.api.compression import Compressor, compressed, compressed_all
from hvdlite.errors import UsageError
from hvdlite.tensorflow import graph
from hvdlite.tensorflow.adapter import TENSORFLOW
from hvdlite.tensorflow.generated import GENERATED, PS, refuse, set_size


# -- alltoall ----------------------------------------------------------------------------------
def _exchange(tensor: tf.Tensor, splits: Optional[np.ndarray], label: Optional[str],
              process_set: PS) -> list[tf.Tensor]:
    """Eager alltoall returning ``[received, received splits (int32, Horovod's
    dtype)]``. Even splits are spelled out so the received splits, which the
    gradient needs, come back too."""
    if splits is None:
        size, rows = set_size(process_set), (tensor.shape[0] if tensor.shape.rank else 0)
        if tensor.shape.rank and rows % size == 0:
            splits = np.full(size, rows // size, dtype=np.int64)
        else:   # no even split: the core's own check raises, and tells the peers
            GENERATED["alltoall"](tensor, None, label, process_set)
    received, counts = GENERATED["alltoall"](tensor, splits, label, process_set)
    return [received, tf.cast(counts, tf.int32)]


def alltoall(tensor: Any, splits: Any = None, name: Optional[str] = None,
             process_set: PS = None, *, ignore_name_scope: bool = False) -> Any:
    """Send ``splits[i]`` rows to rank i (even split when None). Returns the received
    rows, and with ``splits`` given ``(received, rows received per rank)``; the
    received rows are differentiable, the received splits are not."""
    if not TENSORFLOW.is_tensor(tensor):
        return refuse("alltoall", tensor, splits, name, process_set)
    split_inputs = [] if splits is None else [tf.convert_to_tensor(splits)]
    received_splits: list[tf.Tensor] = []   # out of the differentiated function

    @tf.custom_gradient
    def forward(t: tf.Tensor) -> Any:
        label = graph.graph_name("alltoall", name, t)
        received, counts = graph.run(
            lambda e, *s: _exchange(e, s[0].numpy() if s else None, label, process_set),
            [t, *split_inputs], [t.dtype, tf.int32],
            [graph.rows_shape(t), tf.TensorShape([set_size(process_set)])])
        received_splits.append(counts)

        def grad(dy: tf.Tensor) -> tf.Tensor:
            glabel = graph.graph_name("alltoall.grad", None, dy)
            return graph.run(
                lambda d, c: GENERATED["alltoall"](d, c.numpy(), glabel, process_set)[0],
                [dy, counts], [dy.dtype], [t.shape])[0]
        return received, grad
    received = forward(graph.as_tensor(tensor))
    return received if splits is None else (received, received_splits[0])


# -- reducescatter -----------------------------------------------------------------------------
@graph.entry_point   # its UsageError reaches tape.gradient's caller as itself
def _gather_scale(op: Optional[int], prescale: float, postscale: float,
                  process_set: PS) -> float:
    reduction = _hvd.Average if op is None else op
    if reduction not in (_hvd.Average, _hvd.Sum):
        raise UsageError("reducescatter is differentiable only for op=Average or Sum")
    scale = prescale * postscale
    return scale * set_size(process_set) if reduction == _hvd.Sum else scale


def _gathered_grads(dys: Sequence[tf.Tensor], shapes: Sequence[tf.TensorShape],
                    scale: float, process_set: PS) -> list[tf.Tensor]:
    """Allgather each output's gradient back to its input's rows, scaled."""
    label = graph.graph_name("reducescatter.grad", None, dys[0])
    gathered = graph.run(lambda *e: GENERATED["grouped_allgather"](list(e), label, process_set),
                         list(dys), [d.dtype for d in dys], list(shapes))
    return [g * tf.cast(scale, g.dtype) if scale != 1.0 else g for g in gathered]


def _reducescatter_diff(xs: list[tf.Tensor], kind: str, name: Optional[str],
                        op: Optional[int], process_set: PS, prescale: float,
                        postscale: float) -> list[tf.Tensor]:
    """``kind`` (reducescatter or grouped_reducescatter) of ``xs``, differentiable
    per tensor."""
    def scatter(values: list[tf.Tensor], label: Optional[str]) -> list[Any]:
        if kind == "reducescatter":
            return [GENERATED[kind](values[0], label, None, op, process_set, prescale,
                                    postscale)]
        return GENERATED[kind](values, label, None, op, process_set, prescale, postscale)

    @tf.custom_gradient
    def forward(*ts: tf.Tensor) -> Any:
        label = graph.graph_name(kind, name, ts[0])
        outs = graph.run(lambda *e: scatter(list(e), label), ts, [t.dtype for t in ts],
                         [graph.rows_shape(t) for t in ts])

        def grad(*dys: Optional[tf.Tensor]) -> list[tf.Tensor]:
            scale = _gather_scale(op, prescale, postscale, process_set)
            dys = tuple(tf.zeros_like(o) if d is None else d for d, o in zip(dys, outs))
            return _gathered_grads(dys, [t.shape for t in ts], scale, process_set)
        return outs, grad
    return list(forward(*xs))


def reducescatter(tensor: Any, name: Optional[str] = None,
                  compression: Optional[type[Compressor]] = None, op: Optional[int] = None,
                  process_set: PS = None, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0, *, device_dense: str = "",
                  ignore_name_scope: bool = False) -> Any:
    """Reduce across ranks, then rank i keeps the i-th block of rows (the first
    n % P ranks get one row more); differentiable (see the module's docstring)."""
    if not TENSORFLOW.is_tensor(tensor):
        return refuse("reducescatter", tensor, name, compression, op, process_set,
                      prescale_factor, postscale_factor)
    return compressed(compression, graph.as_tensor(tensor), lambda wire: _reducescatter_diff(
        [wire], "reducescatter", name, op, process_set, prescale_factor, postscale_factor)[0])


def grouped_reducescatter(tensors: Sequence[Any], name: Optional[str] = None,
                          compression: Optional[type[Compressor]] = None,
                          op: Optional[int] = None, process_set: PS = None,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                          **horovod: Any) -> list[Any]:
    """``reducescatter`` of each tensor (ops named ``<name>.<i>``), differentiable
    per tensor."""
    tensors = list(tensors)
    if not tensors or not all(TENSORFLOW.is_tensor(t) for t in tensors):
        return GENERATED["grouped_reducescatter"](tensors, name, compression, op, process_set,
                                                  prescale_factor, postscale_factor)
    return compressed_all(compression, [graph.as_tensor(t) for t in tensors],
                          lambda wires: _reducescatter_diff(
                              list(wires), "grouped_reducescatter", name, op, process_set,
                              prescale_factor, postscale_factor))
