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
from hvdlite.negotiation.requests import Kind
from hvdlite.tensorflow import graph, scatter, sparse
from hvdlite.tensorflow.adapter import TENSORFLOW, is_keras_variable, is_variable
from hvdlite.tensorflow.gather import allgather, grouped_allgather
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


def allreduce(tensor: Any, average: Optional[bool] = None, name: Optional[str] = None,
              compression: Optional[type[Compressor]] = None, op: Optional[int] = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: PS = None, *, device_dense: str = "", device_sparse: str = "",
              ignore_name_scope: bool = False) -> Any:
    """Differentiable allreduce (default op: Average), eager or in tf.function.
    ``tf.IndexedSlices`` are reduced by allgather (see ``sparse``). The
    ``device_*`` and ``ignore_name_scope`` arguments are accepted for Horovod."""
    if isinstance(tensor, tf.IndexedSlices):
        reduction = sparse.check_sparse("allreduce", average, op, prescale_factor,
                                        postscale_factor)
        return sparse.reduce_slices([tensor], reduction, name, process_set)[0]
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
    """Differentiable per tensor, eager or in tf.function; ops named ``<name>.<i>``.
    ``tf.IndexedSlices`` in the list are reduced together by allgather (``sparse``)."""
    tensors = list(tensors)
    if any(isinstance(t, tf.IndexedSlices) for t in tensors):
        return _grouped_mixed(tensors, average, name, compression, op, prescale_factor,
                              postscale_factor, process_set)
    if not tensors or not all(TENSORFLOW.is_tensor(t) for t in tensors):
        return _OPS["grouped_allreduce"](tensors, average, name, compression, op,
                                         prescale_factor, postscale_factor, process_set)
    return compressed_all(compression, [graph.as_tensor(t) for t in tensors],
                          lambda wires: _grouped_allreduce_diff(
                              wires, average, name, op, prescale_factor, postscale_factor,
                              process_set))


def _grouped_mixed(tensors: list[Any], average: Optional[bool], name: Optional[str],
                   compression: Optional[type[Compressor]], op: Optional[int],
                   prescale: float, postscale: float, process_set: PS) -> list[Any]:
    """A list holding tf.IndexedSlices: the slices in one grouped allgather, the
    dense tensors in one grouped allreduce, results in the list's order."""
    reduction = sparse.check_sparse("grouped_allreduce", average, op, prescale, postscale)
    where = [isinstance(t, tf.IndexedSlices) for t in tensors]
    slices = sparse.reduce_slices([t for t, s in zip(tensors, where) if s], reduction,
                                  None if name is None else f"{name}.sparse", process_set)
    dense_in = [t for t, s in zip(tensors, where) if not s]
    dense = grouped_allreduce(dense_in, average, name, compression, op, prescale, postscale,
                              process_set) if dense_in else []
    dense_out, sparse_out = iter(dense), iter(slices)
    return [next(sparse_out) if s else next(dense_out) for s in where]


# -- broadcast -------------------------------------------------------------------
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
def assigned(variables: list[Any], values: list[tf.Tensor]) -> list[tf.Tensor]:
    """Assign each value to its variable in a graph; returns the new values, read after
    every assignment. A TF1 graph (run by a Session) runs only what a fetched tensor
    depends on: an assignment nothing depends on never runs, and the variable then reads
    its old value (tf.function's automatic control dependencies do not reach there)."""
    targets = [_assignable(v) for v in variables]
    updates = [t.assign(tf.cast(x, t.dtype)) for t, x in zip(targets, values)]
    with tf.control_dependencies(updates):
        return [tf.identity(t) for t in targets]


def _assignable(variable: Any) -> Any:
    """The tf.Variable to assign: a Keras variable's assign drops the assign op in a TF1
    graph, so assign the tf.Variable behind it."""
    return variable.value if is_keras_variable(variable) else variable


def allreduce_(tensor: Any, average: Optional[bool] = None, name: Optional[str] = None,
               op: Optional[int] = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0, process_set: PS = None) -> Any:
    """Reduce a tf.Variable (or Keras variable) in place; returns it (in a TF1 graph, its
    new value, which runs the reduction when fetched)."""
    if graph.eager() or not is_variable(tensor):
        return _OPS["allreduce_"](tensor, average, name, op, prescale_factor, postscale_factor,
                                  process_set)
    reduced = allreduce(tensor, average, name, None, op, prescale_factor, postscale_factor,
                        process_set)
    new_value = assigned([tensor], [reduced])[0]
    return tensor if tf.inside_function() else new_value


def broadcast_(tensor: Any, root_rank: int, name: Optional[str] = None,
               process_set: PS = None) -> Any:
    """Overwrite a tf.Variable (or Keras variable) with ``root_rank``'s value; returns it
    (in a TF1 graph, its new value, which runs the broadcast when fetched). Given a list of
    variables (Horovod's TensorFlow form), overwrites each and returns their new values, as
    tensors."""
    if isinstance(tensor, (list, tuple)):
        return _broadcast_variables_(list(tensor), root_rank, name, process_set)
    if graph.eager() or not is_variable(tensor):
        return _OPS["broadcast_"](tensor, root_rank, name, process_set)
    new_value = assigned([tensor], [broadcast(tensor, root_rank, name, process_set)])[0]
    return tensor if tf.inside_function() else new_value


def _broadcast_variables_(variables: list[Any], root_rank: int, name: Optional[str],
                          process_set: PS) -> list[tf.Tensor]:
    names = [None if name is None else f"{name}.{i}" for i in range(len(variables))]
    if graph.eager():
        handles = [_OPS["broadcast_async_"](v, root_rank, n, process_set)
                   for v, n in zip(variables, names)]
        for handle in handles:
            _OPS["synchronize"](handle)
        return [graph.as_tensor(v) for v in variables]
    values = [broadcast(v, root_rank, label, process_set) for v, label in zip(variables, names)]
    return assigned(variables, values)


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
    new_values = assigned(tensors, reduced)
    return tensors if tf.inside_function() else new_values


# -- the other collectives: graph-capable, not differentiable ---------------------------------
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
