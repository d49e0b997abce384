"""Averaging a list of TensorFlow gradients across ranks, eager or inside
tf.function: what DistributedGradientTape and the Keras DistributedOptimizer
(TensorFlow backend) do with the gradients they are given.

Dense gradients go to the reducer's buckets (``hvdlite.reducer``) in one call:
inside a graph, one py_function per step for all of them. ``tf.IndexedSlices``
(an Embedding's gradient) are reduced by allgather (one grouped op), or densified
first with ``sparse_as_dense=True``. A missing gradient (None) takes part as
zeros, so a rank whose loss does not reach some variable still matches the others;
one that no rank has stays None (the optimizer skips its variable). Eagerly, the
bucket's flags say so at each call; in a traced function, where a gradient's being
None is fixed when traced, the ranks agree on it with the layout, once.
TensorFlow's tensors cannot be views of a buffer, so the buckets live in host
memory: each gradient is copied in, and out as a new tensor.
"""
from __future__ import annotations

from typing import Any, Optional

import tensorflow as tf

from hvdlite.api.compression import Compression, Compressor
from hvdlite.api.process_set import ProcessSet
from hvdlite.reduce_op import ReduceOp
from hvdlite.reducer.lists import GradientLists
from hvdlite.reducer.settings import Groups, Settings
from hvdlite.tensorflow import graph
from hvdlite.tensorflow.adapter import TENSORFLOW
from hvdlite.tensorflow.functions import check_same_variables, variable_name
from hvdlite.tensorflow.sparse import reduce_slices


class GradientAverager(GradientLists):
    """The averaging of one DistributedGradientTape or DistributedOptimizer."""

    def __init__(self, what: str, compression: type[Compressor] = Compression.none,
                 sparse_as_dense: bool = False, op: int = ReduceOp.AVERAGE,
                 predivide: float = 1.0, groups: Groups = None,
                 process_set: Optional[ProcessSet] = None, scale_local: bool = True) -> None:
        super().__init__(TENSORFLOW, Settings(what, compression, op, predivide, 1, groups,
                                              process_set), scale_local)
        self.sparse_as_dense = sparse_as_dense
        self._checked: set = set()       # lists of sparse variables already compared

    def reduce_shared(self, grads: list[Any], variables: list[Any]) -> list[Any]:
        if self.settings.alone():
            return [None if g is None else self._densify(g, v) for g, v in zip(grads, variables)]
        missing = {i for i, g in enumerate(grads) if g is None}
        grads = [self._densify(g, v) for g, v in zip(grads, variables)]
        sparse = [i for i, g in enumerate(grads) if isinstance(g, tf.IndexedSlices)]
        dense = [i for i in range(len(grads)) if i not in set(sparse)]
        if sparse:
            self._check([variables[i] for i in sparse])
            slices = reduce_slices([grads[i] for i in sparse], self.settings.op,
                                   f"{self.settings.what}.sparse", self.settings.process_set)
            for i, value in zip(sparse, slices):
                grads[i] = value
        if dense:
            reduced = self._reduce_dense([grads[i] for i in dense], [variables[i] for i in dense],
                                         [k for k, i in enumerate(dense) if i in missing])
            for i, value in zip(dense, reduced):
                grads[i] = value
        return grads

    def _reduce_dense(self, grads: list[Any], variables: list[Any],
                      absent: list[int]) -> list[Any]:
        """One call of the reducer (a py_function inside a graph). Its buckets are made,
        and the ranks' variables compared, when it is first traced or called.
        ``absent``: the gradients that were None (zeros here); those no rank has come
        back None."""
        specs = [(variable_name(v, i), tuple(tf.TensorShape(v.shape).as_list()),
                  tf.as_dtype(g.dtype).name, "cpu") for i, (g, v) in enumerate(zip(grads, variables))]
        eager = graph.eager()
        present = None if eager or not absent else [i not in absent for i in range(len(grads))]
        reducer = self.reducer(specs, variables, present)
        reduced = graph.run(lambda *tensors: reducer.reduce(tensors, absent if eager else ()),
                            grads, [g.dtype for g in grads], [g.shape for g in grads])
        unused = reducer.unused if eager else reducer.never
        return [None if i in unused else r for i, r in enumerate(reduced)]

    def _check(self, variables: list[Any]) -> None:
        """The sparse gradients' variables, the same on every rank (the dense ones' are
        compared by their reducer), else a MismatchError everywhere."""
        key = tuple(id(v) for v in variables)
        if key not in self._checked:
            check_same_variables(variables, f"{self.settings.what}.sparse",
                                 self.settings.process_set)
            self._checked.add(key)

    def _densify(self, grad: Any, variable: Any) -> Any:
        if grad is None:
            return tf.zeros(variable.shape, dtype=tf.as_dtype(variable.dtype))
        if isinstance(grad, tf.IndexedSlices) and self.sparse_as_dense:
            return tf.convert_to_tensor(grad)
        return grad

    def scaled(self, grad: Any, scale: float) -> Any:
        if isinstance(grad, tf.IndexedSlices):
            return tf.IndexedSlices(grad.values * tf.cast(scale, grad.values.dtype),
                                    grad.indices, grad.dense_shape)
        return grad * tf.cast(scale, grad.dtype)
