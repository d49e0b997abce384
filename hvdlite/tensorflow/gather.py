"""``allgather`` and ``grouped_allgather`` on TensorFlow tensors, eager or inside
``tf.function``, differentiable with Horovod's convention: the gradient of a
gathered tensor is averaged over the ranks, and each rank keeps the rows it
contributed (whose count the others learn at run time: the first dimension may
differ between ranks)."""
from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np
import tensorflow as tf

import hvdlite as _hvd
from hvdlite.tensorflow import graph
from hvdlite.tensorflow.adapter import TENSORFLOW
from hvdlite.tensorflow.generated import GENERATED as _OPS, PS
from hvdlite.tensorflow.generated import member_rank as _member_rank, refuse as _refuse


def _gathered_grads(dys: Sequence[tf.Tensor], rows: Sequence[tf.Tensor],
                    shapes: Sequence[tf.TensorShape], label: Optional[str],
                    process_set: PS) -> list[tf.Tensor]:
    """Average each gradient over ranks (one grouped allreduce), then keep this
    rank's rows of each; one allgather tells every rank every rank's row counts."""
    count = len(dys)

    def eager_grads(*tensors: tf.Tensor) -> list[tf.Tensor]:
        mine = np.array([[int(r) for r in tensors[count:]]], dtype=np.int64)
        reduced = _OPS["grouped_allreduce"](list(tensors[:count]), op=_hvd.Average,
                                            name=label, process_set=process_set)
        counts = _hvd.allgather(mine, name=None if label is None else f"{label}.rows",
                                process_set=process_set)
        starts = counts[:_member_rank(process_set)].sum(axis=0)
        parts = []
        for i, (whole, shape) in enumerate(zip(reduced, shapes)):
            part = whole[int(starts[i]):int(starts[i]) + int(mine[0, i])]
            parts.append(tf.reshape(part, []) if shape.rank == 0 else part)
        return parts
    return graph.run(eager_grads, list(dys) + list(rows), [d.dtype for d in dys], shapes)


def _rows(t: tf.Tensor) -> tf.Tensor:
    return tf.constant(1) if t.shape.rank == 0 else tf.shape(t)[0]


def _gather(xs: list[tf.Tensor], kind: str, name: Optional[str],
            process_set: PS) -> list[tf.Tensor]:
    @tf.custom_gradient
    def forward(*ts: tf.Tensor) -> Any:
        label = graph.graph_name(kind, name, ts[0])

        def gather(*e: tf.Tensor) -> Any:
            if kind == "allgather":     # one op of its own, named as given
                return _OPS["allgather"](e[0], label, process_set)
            return _OPS["grouped_allgather"](list(e), label, process_set)
        out = graph.run(gather, ts, [t.dtype for t in ts], [graph.rows_shape(t) for t in ts])

        def grad(*dys: tf.Tensor) -> list[tf.Tensor]:
            return _gathered_grads(dys, [_rows(t) for t in ts], [t.shape for t in ts],
                                   graph.graph_name(f"{kind}.grad", None, dys[0]), process_set)
        return out, grad
    return list(forward(*xs))


def allgather(tensor: Any, name: Optional[str] = None, process_set: PS = None, *,
              ignore_name_scope: bool = False) -> Any:
    """Concatenate every rank's tensor on the first dimension (which may differ)."""
    if not TENSORFLOW.is_tensor(tensor):
        return _refuse("allgather", tensor, name, process_set)
    return _gather([graph.as_tensor(tensor)], "allgather", name, process_set)[0]


def grouped_allgather(tensors: Sequence[Any], name: Optional[str] = None,
                      process_set: PS = None, **horovod: Any) -> list[Any]:
    """Allgather each tensor, as one group (ops named ``<name>.<i>``)."""
    tensors = list(tensors)
    if not tensors or not all(TENSORFLOW.is_tensor(t) for t in tensors):
        return _OPS["grouped_allgather"](tensors, name, process_set)
    return _gather([graph.as_tensor(t) for t in tensors], "grouped_allgather", name,
                   process_set)
