"""Reducing ``tf.IndexedSlices`` (an Embedding's gradient), as Horovod does:
every rank's rows and their indices are allgathered (duplicate indices add up
when the slices are applied), and divided by the set size for Average.

Only Average and Sum have that meaning, and a pre- or post-scale factor is
refused rather than ignored, as Horovod refuses them (NotImplementedError): a
script that asked for them gets an error, never a silently unscaled sum. Lists
that mix dense tensors and slices (``grouped_allreduce``) reduce the slices of
the whole list in one grouped allgather.
"""
from __future__ import annotations

from typing import Optional, Sequence

import tensorflow as tf

from hvdlite.api import submission
from hvdlite.errors import NotSupportedError
from hvdlite.reduce_op import ReduceOp
from hvdlite.tensorflow import graph
from hvdlite.tensorflow.generated import GENERATED, PS, set_size


def check_sparse(what: str, average: Optional[bool], op: Optional[int], prescale: float,
                 postscale: float) -> int:
    """The reduction to apply to slices, or NotSupportedError naming the argument."""
    reduction = submission.reduce_op(op, average)
    if reduction not in (ReduceOp.AVERAGE, ReduceOp.SUM):
        raise NotSupportedError(
            f"{what}: tf.IndexedSlices are reduced with op=Average or Sum only (got "
            f"{ReduceOp(reduction).name}); pass sparse_as_dense=True or densify the slices "
            "(tf.convert_to_tensor) for other ops")
    if prescale != 1.0 or postscale != 1.0:
        raise NotSupportedError(
            f"{what}: prescale_factor and postscale_factor are not supported on "
            f"tf.IndexedSlices (got {prescale} and {postscale}); scale the slices' values "
            "yourself, or densify them (tf.convert_to_tensor) first")
    return reduction


def reduce_slices(slices: Sequence[tf.IndexedSlices], reduction: int, name: Optional[str],
                  process_set: PS) -> list[tf.IndexedSlices]:
    """Every rank's rows of each of ``slices``, in one grouped allgather (values and
    indices), eager or inside tf.function."""
    parts = [s.values for s in slices] + [s.indices for s in slices]
    label = graph.graph_name("sparse_allreduce", name, parts[0])
    gathered = graph.run(
        lambda *e: GENERATED["grouped_allgather"](list(e), label, process_set), parts,
        [p.dtype for p in parts], [graph.rows_shape(p) for p in parts])
    count = len(slices)
    reduced = []
    for s, values, indices in zip(slices, gathered[:count], gathered[count:]):
        if reduction == ReduceOp.AVERAGE:
            values = values / tf.cast(set_size(process_set), values.dtype)
        reduced.append(tf.IndexedSlices(values, indices, dense_shape=s.dense_shape))
    return reduced
