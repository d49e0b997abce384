"""The runtime's collectives on TensorFlow tensors: the op set generated from the
TensorFlow adapter (``hvdlite.api.binding``), extended to run inside
``tf.function`` (see ``graph``) and differentiable with Horovod's conventions:
the gradient of allreduce is the allreduce of the gradient; the gradients of
allgather and broadcast are averaged over ranks (broadcast's non-root ranks get
zeros). ``grouped_allreduce`` is differentiable per tensor; alltoall and the
reducescatters are in ``scatter``. The ``*_async``
forms, ``synchronize`` and ``poll`` are eager-only, as in Horovod.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np
import tensorflow as tf

import hvdlite as _hvd
from hvdlite.api import submission
from hvdlite.api.compression import Compressor, compressed, compressed_all
from hvdlite.core.requests import Kind
from hvdlite.tensorflow import graph, scatter
from hvdlite.tensorflow.adapter import TENSORFLOW, is_variable
from hvdlite.tensorflow.generated import GENERATED as _OPS, PS
from hvdlite.tensorflow.generated import member_rank as _member_rank, refuse as _refuse

Average = _hvd.Average


# -- allreduce ---------------------------------------------------------------------------------
def _allreduce_diff(x: tf.Tensor, average: Optional[bool], name: Optional[str],
                    op: Optional[int], prescale: float, postscale: float,
                    process_set: PS) -> tf.Tensor:
    def reduce(value: tf.Tensor, label: Optional[str]) -> tf.Tensor:
        return graph.run(lambda e: _OPS["allreduce"](e, average, label, None, op, prescale,
                                                     postscale, process_set),
                         [value], [value.dtype], [value.shape])[0]

    @tf.custom_gradient
    def forward(t: tf.Tensor) -> Any:
        def grad(dy: tf.Tensor) -> tf.Tensor:
            return reduce(dy, graph.graph_name("allreduce.grad", None, dy))
        return reduce(t, graph.graph_name("allreduce", name, t)), grad
    return forward(x)


def _sparse_allreduce(slices: tf.IndexedSlices, average: Optional[bool], name: Optional[str],
                      op: Optional[int], process_set: PS) -> tf.IndexedSlices:
    """Horovod's reduction of IndexedSlices: allgather the rows and their indices
    (duplicate indices add up when applied), dividing by the set size for Average."""
    reduction = submission.reduce_op(op, average)
    if reduction not in (_hvd.Average, _hvd.Sum):
        raise _hvd.UsageError("IndexedSlices are reduced with op=Average or Sum only")
    base = graph.graph_name("sparse_allreduce", name, slices.values)
    names = (None, None) if base is None else (f"{base}.values", f"{base}.indices")
    values = allgather(slices.values, name=names[0], process_set=process_set)
    indices = allgather(slices.indices, name=names[1], process_set=process_set)
    if reduction == _hvd.Average:
        size = _hvd.size() if process_set is None else process_set.size()
        values = values / tf.cast(size, values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=slices.dense_shape)


def allreduce(tensor: Any, average: Optional[bool] = None, name: Optional[str] = None,
              compression: Optional[type[Compressor]] = None, op: Optional[int] = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: PS = None, *, device_dense: str = "", device_sparse: str = "",
              ignore_name_scope: bool = False) -> Any:
    """Differentiable allreduce (default op: Average), eager or in tf.function.
    ``tf.IndexedSlices`` are reduced by allgather (Average or Sum). The
    ``device_*`` and ``ignore_name_scope`` arguments are accepted for Horovod."""
    if isinstance(tensor, tf.IndexedSlices):
        return _sparse_allreduce(tensor, average, name, op, process_set)
    if not TENSORFLOW.is_tensor(tensor):
        return _refuse("allreduce", tensor, average, name, compression, op, prescale_factor,
                       postscale_factor, process_set)
    return compressed(compression, graph.as_tensor(tensor), lambda wire: _allreduce_diff(
        wire, average, name, op, prescale_factor, postscale_factor, process_set))


def _grouped_allreduce_diff(xs: list[tf.Tensor], average: Optional[bool], name: Optional[str],
                            op: Optional[int], prescale: float, postscale: float,
                            process_set: PS) -> list[tf.Tensor]:
    def reduce(values: Sequence[tf.Tensor], label: Optional[str]) -> list[tf.Tensor]:
        return graph.run(lambda *e: _OPS["grouped_allreduce"](list(e), average, label, None, op,
                                                              prescale, postscale, process_set),
                         values, [v.dtype for v in values], [v.shape for v in values])

    @tf.custom_gradient
    def forward(*ts: tf.Tensor) -> Any:
        def grad(*dys: tf.Tensor) -> list[tf.Tensor]:
            return reduce(dys, graph.graph_name("grouped_allreduce.grad", None, dys[0]))
        return reduce(ts, graph.graph_name("grouped_allreduce", name, ts[0])), grad
    return list(forward(*xs))


def grouped_allreduce(tensors: Sequence[Any], average: Optional[bool] = None,
                      name: Optional[str] = None,
                      compression: Optional[type[Compressor]] = None, op: Optional[int] = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: PS = None, **horovod: Any) -> list[Any]:
    """Differentiable per tensor, eager or in tf.function; ops named ``<name>.<i>``."""
    tensors = list(tensors)
    if not tensors or not all(TENSORFLOW.is_tensor(t) for t in tensors):
        return _OPS["grouped_allreduce"](tensors, average, name, compression, op,
                                         prescale_factor, postscale_factor, process_set)
    return compressed_all(compression, [graph.as_tensor(t) for t in tensors],
                          lambda wires: _grouped_allreduce_diff(
                              wires, average, name, op, prescale_factor, postscale_factor,
                              process_set))


# -- allgather and broadcast -------------------------------------------------------------------
def _allgather_grad(dy: tf.Tensor, rows: tf.Tensor, shape: tf.TensorShape,
                    label: Optional[str], process_set: PS) -> tf.Tensor:
    """Average the gradient over ranks, keep this rank's rows (``rows`` is a tensor:
    the first dimension may be known only at run time)."""
    def eager_grad(d: tf.Tensor, mine: tf.Tensor) -> tf.Tensor:
        count = int(mine)
        reduced = _OPS["allreduce"](d, op=Average, name=label, process_set=process_set)
        counts = _hvd.allgather(np.array([count], dtype=np.int64),
                                name=None if label is None else f"{label}.rows",
                                process_set=process_set)
        start = int(counts[:_member_rank(process_set)].sum())
        part = reduced[start:start + count]
        return tf.reshape(part, []) if shape.rank == 0 else part
    return graph.run(eager_grad, [dy, rows], [dy.dtype], [shape])[0]


def allgather(tensor: Any, name: Optional[str] = None, process_set: PS = None, *,
              ignore_name_scope: bool = False) -> Any:
    """Concatenate every rank's tensor on the first dimension (which may differ);
    differentiable: the gradient is averaged over ranks, then this rank's rows kept."""
    if not TENSORFLOW.is_tensor(tensor):
        return _refuse("allgather", tensor, name, process_set)
    x = graph.as_tensor(tensor)

    @tf.custom_gradient
    def forward(t: tf.Tensor) -> Any:
        label = graph.graph_name("allgather", name, t)
        out = graph.run(lambda e: _OPS["allgather"](e, label, process_set), [t], [t.dtype],
                        [graph.rows_shape(t)])[0]

        def grad(dy: tf.Tensor) -> tf.Tensor:
            rows = tf.constant(1) if t.shape.rank == 0 else tf.shape(t)[0]
            return _allgather_grad(dy, rows, t.shape,
                                   graph.graph_name("allgather.grad", None, dy), process_set)
        return out, grad
    return forward(x)


def broadcast(tensor: Any, root_rank: int, name: Optional[str] = None, process_set: PS = None,
              *, ignore_name_scope: bool = False) -> Any:
    """Every rank receives ``root_rank``'s tensor; differentiable: the root gets the
    rank-averaged gradient, other ranks zeros."""
    if not TENSORFLOW.is_tensor(tensor):
        return _refuse("broadcast", tensor, root_rank, name, process_set)
    x = graph.as_tensor(tensor)

    @tf.custom_gradient
    def forward(t: tf.Tensor) -> Any:
        label = graph.graph_name("broadcast", name, t)
        out = graph.run(lambda e: _OPS["broadcast"](e, root_rank, label, process_set), [t],
                        [t.dtype], [t.shape])[0]

        def grad(dy: tf.Tensor) -> tf.Tensor:
            glabel = graph.graph_name("broadcast.grad", None, dy)
            reduced = graph.run(lambda e: _OPS["allreduce"](e, op=Average, name=glabel,
                                                           process_set=process_set),
                                [dy], [dy.dtype], [dy.shape])[0]
            # root_rank is a global rank, as in Horovod
            return reduced if _hvd.rank() == root_rank else tf.zeros_like(reduced)
        return out, grad
    return forward(x)


# -- in-place forms on variables: eager through the adapter, assign in a graph ----------------
def allreduce_(tensor: Any, average: Optional[bool] = None, name: Optional[str] = None,
               op: Optional[int] = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0, process_set: PS = None) -> Any:
    """Reduce a tf.Variable (or Keras variable) in place; returns it."""
    if graph.eager() or not is_variable(tensor):
        return _OPS["allreduce_"](tensor, average, name, op, prescale_factor, postscale_factor,
                                  process_set)
    tensor.assign(allreduce(tensor, average, name, None, op, prescale_factor, postscale_factor,
                            process_set))
    return tensor


def broadcast_(tensor: Any, root_rank: int, name: Optional[str] = None,
               process_set: PS = None) -> Any:
    """Overwrite a tf.Variable (or Keras variable) with ``root_rank``'s value; returns it."""
    if graph.eager() or not is_variable(tensor):
        return _OPS["broadcast_"](tensor, root_rank, name, process_set)
    tensor.assign(broadcast(tensor, root_rank, name, process_set))
    return tensor


def grouped_allreduce_(tensors: Sequence[Any], average: Optional[bool] = None,
                       name: Optional[str] = None, op: Optional[int] = None,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: PS = None) -> list[Any]:
    tensors = list(tensors)
    if graph.eager() or not tensors or not all(is_variable(t) for t in tensors):
        return _OPS["grouped_allreduce_"](tensors, average, name, op, prescale_factor,
                                          postscale_factor, process_set)
    reduced = grouped_allreduce(tensors, average, name, None, op, prescale_factor,
                                postscale_factor, process_set)
    for variable, value in zip(tensors, reduced):
        variable.assign(value)
    return tensors


# -- the other collectives: graph-capable, not differentiable ---------------------------------
def grouped_allgather(tensors: Sequence[Any], name: Optional[str] = None,
                      process_set: PS = None, **horovod: Any) -> list[Any]:
    """Allgather each tensor (ops named ``<name>.<i>``), eager or in tf.function."""
    tensors = list(tensors)
    if graph.eager() or not tensors or not all(TENSORFLOW.is_tensor(t) for t in tensors):
        return _OPS["grouped_allgather"](tensors, name, process_set)
    xs = [graph.as_tensor(t) for t in tensors]
    label = graph.graph_name("grouped_allgather", name, xs[0])
    return graph.run(lambda *e: _OPS["grouped_allgather"](list(e), label, process_set), xs,
                     [x.dtype for x in xs], [graph.rows_shape(x) for x in xs])


def barrier(process_set: PS = None) -> None:
    """Wait until every rank of the set arrives (eager or in tf.function)."""
    if graph.eager():
        return _OPS["barrier"](process_set)
    label = tf.compat.v1.get_default_graph().unique_name("barrier", mark_as_used=True)

    def wait() -> list[tf.Tensor]:
        submission.synchronize(submission.Call(Kind.BARRIER, label, process_set).submit(None))
        return []
    tf.py_function(wait, [], Tout=[], name="HvdliteBarrier")
    return None


def join(device: int = -1) -> Any:
    """Signal this rank is out of data; returns the last rank to join (a tensor
    inside tf.function)."""
    if graph.eager():
        return _OPS["join"](device)
    return tf.py_function(lambda: tf.constant(_OPS["join"](device), tf.int32), [],
                          Tout=tf.int32, name="HvdliteJoin")


# The generated op set, with the graph-capable and differentiable forms above.
OPS: dict[str, Any] = {name: graph.entry_point(fn) for name, fn in dict(
    _OPS, allreduce=allreduce, grouped_allreduce=grouped_allreduce, allgather=allgather,
    broadcast=broadcast, allreduce_=allreduce_, broadcast_=broadcast_,
    grouped_allreduce_=grouped_allreduce_, grouped_allgather=grouped_allgather,
    alltoall=scatter.alltoall, reducescatter=scatter.reducescatter,
    grouped_reducescatter=scatter.grouped_reducescatter, barrier=barrier, join=join).items()}
