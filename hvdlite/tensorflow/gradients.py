"""Averaging a list of TensorFlow gradients across ranks, eager or inside
tf.function: what DistributedGradientTape and the Keras DistributedOptimizer
(TensorFlow backend) do with the gradients they are given.

Dense gradients go through ``hvdlite.api.gradients.reduce_all`` (groups,
compression, gradient_predivide_factor), one grouped op per group so a whole
step is one py_function per group inside a graph. ``tf.IndexedSlices`` (an
Embedding's gradient) are reduced by allgather, or densified first with
``sparse_as_dense=True``. A missing gradient (None) takes part as zeros, so a
rank whose loss does not reach some variable still matches the others.
Worker-local variables (``register_local_source``, ``local_layers``) are left
out of the reduction and of the check that ranks train the same variables (a
model-parallel layer may differ in shape between ranks); their gradients are
divided by the set size unless ``scale_local_gradients=False``, as Horovod's.
"""
from __future__ import annotations

from typing import Any, Sequence

import tensorflow as tf

from hvdlite.api.gradients import AveragerSettings, plan_groups, reduce_all, scaled_op
from hvdlite.errors import UsageError
from hvdlite.tensorflow.functions import check_same_variables, variable_specs
from hvdlite.tensorflow.ops import OPS


class GradientAverager(AveragerSettings):
    """The settings of one DistributedGradientTape or DistributedOptimizer."""

    def check_variables(self, variables: Sequence[Any]) -> None:
        """Once per distinct variable list: the same variables on every rank,
        else a MismatchError everywhere (instead of a hang on a missing op)."""
        key = tuple(variable_specs(variables))
        if key not in self.checked:
            check_same_variables(variables, self.what, self.process_set)
            self.checked.add(key)

    def __call__(self, grads: Sequence[Any], variables: Sequence[Any]) -> list[Any]:
        grads = list(grads)
        if len(grads) != len(variables):
            raise UsageError(f"{self.what}: {len(grads)} gradients for {len(variables)} "
                             "variables")
        if self.outside_set():
            return grads
        shared, local = self.split_local(variables)
        reduced = self._reduce_shared([grads[i] for i in shared],
                                      [variables[i] for i in shared])
        for i, value in zip(shared, reduced):
            grads[i] = value
        scale = self.local_scale()
        for i in local:
            grads[i] = _scaled(grads[i], scale)
        return grads

    def _reduce_shared(self, grads: list[Any], variables: list[Any]) -> list[Any]:
        self.check_variables(variables)
        grads = [self._densify(g, v) for g, v in zip(grads, variables)]
        if self.alone():
            return grads
        dense = [i for i, g in enumerate(grads) if not isinstance(g, tf.IndexedSlices)]
        reduced = self._reduce_dense([grads[i] for i in dense], [variables[i] for i in dense])
        for i, value in zip(dense, reduced):
            grads[i] = value
        for i, grad in enumerate(grads):
            if isinstance(grad, tf.IndexedSlices):
                grads[i] = OPS["allreduce"](grad, name=f"{self.what}.sparse.{i}", op=self.op,
                                            process_set=self.process_set)
        return grads

    def _reduce_dense(self, grads: list[Any], variables: list[Any]) -> list[Any]:
        """Bucketed (one flat allreduce per bucket: one request, one py_function), or
        one grouped op per ``groups=`` group."""
        if not grads:
            return []
        sizes = [g.shape.num_elements() for g in grads]
        plan = None if None in sizes else self.bucket_layout(
            [n * g.dtype.size for n, g in zip(sizes, grads)], [g.dtype for g in grads])
        if plan is None:
            by_id = {id(v): n for n, v in enumerate(variables)}
            groups = plan_groups(list(range(len(grads))), self.groups,
                                 key_of=lambda v: by_id[id(v)])
            return reduce_all(OPS["grouped_allreduce"], grads, f"{self.what}.grads",
                              self.compression, self.op, self.predivide, groups,
                              self.process_set)
        op, prescale, postscale = scaled_op(self.op, self.predivide, self.process_set)
        reduced = list(grads)
        for number, members in enumerate(plan):
            flat = tf.concat([tf.reshape(grads[i], [-1]) for i in members], axis=0)
            total = OPS["allreduce"](flat, name=f"{self.what}.bucket.{number}",
                                     compression=self.compression, op=op,
                                     prescale_factor=prescale, postscale_factor=postscale,
                                     process_set=self.process_set)
            for i, part in zip(members, tf.split(total, [sizes[i] for i in members])):
                reduced[i] = tf.reshape(part, grads[i].shape)
        return reduced

    def _densify(self, grad: Any, variable: Any) -> Any:
        if grad is None:
            return tf.zeros(variable.shape, dtype=tf.as_dtype(variable.dtype))
        if isinstance(grad, tf.IndexedSlices) and self.sparse_as_dense:
            return tf.convert_to_tensor(grad)
        return grad


def _scaled(grad: Any, scale: float) -> Any:
    """A worker-local gradient times ``scale`` (None stays None: nothing to apply)."""
    if grad is None or scale == 1.0:
        return grad
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values * tf.cast(scale, grad.values.dtype), grad.indices,
                                grad.dense_shape)
    return grad * tf.cast(scale, grad.dtype)
