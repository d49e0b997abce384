"""``SyncBatchNormalization``: Keras' BatchNormalization whose training-time batch
statistics are those of the global batch (every rank's shard), as Horovod's.

Each rank sums its per-channel count, sum and sum of squares in one allreduce,
so the mean and (biased) variance are exactly the global batch's even when the
ranks' batches differ in size (Horovod averages the ranks' means, which assumes
equal batches). The allreduce is hvdlite's differentiable one: the gradient
flows back through the global statistics to every rank's inputs. Inference
uses the moving averages, which therefore stay identical across ranks.
"""
from __future__ import annotations

from typing import Any, Optional

import keras
import tensorflow as tf

import hvdlite as _hvd
from hvdlite.errors import UsageError
from hvdlite.tensorflow.generated import set_size
from hvdlite.tensorflow.ops import OPS


class SyncBatchNormalization(keras.layers.BatchNormalization):
    """Horovod's ``SyncBatchNormalization`` for Keras 3 on TensorFlow. Takes Keras'
    BatchNormalization arguments; ``fused`` is accepted for Horovod (False only)."""

    def __init__(self, *args: Any, fused: Optional[bool] = False, **kwargs: Any) -> None:
        if fused:
            raise UsageError("SyncBatchNormalization does not support fused=True (Keras 3 has "
                             "no fused kernel); leave fused unset or False")
        super().__init__(*args, **kwargs)

    def _moments(self, inputs: tf.Tensor, mask: Any) -> tuple[tf.Tensor, tf.Tensor]:
        mean, variance = super()._moments(inputs, mask)
        if set_size(None) == 1:
            return mean, variance
        wide = tf.float64 if mean.dtype == tf.float64 else tf.float32
        shape = tf.shape(mean)
        mean = tf.reshape(tf.cast(mean, wide), [-1])
        variance = tf.reshape(tf.cast(variance, wide), [-1])
        count = self._count(inputs, mask, wide)
        local = tf.concat([[count], mean * count, (variance + mean * mean) * count], axis=0)
        total = OPS["allreduce"](local, op=_hvd.Sum, name=None)
        channels = tf.size(mean)
        global_mean = total[1:1 + channels] / total[0]
        global_variance = total[1 + channels:] / total[0] - global_mean * global_mean
        return (tf.reshape(tf.cast(global_mean, inputs.dtype), shape),
                tf.reshape(tf.cast(tf.maximum(global_variance, 0.0), inputs.dtype), shape))

    def _count(self, inputs: tf.Tensor, mask: Any, dtype: tf.DType) -> tf.Tensor:
        """Values per channel in this rank's batch (masked entries left out)."""
        if mask is not None:
            weights = tf.broadcast_to(tf.cast(tf.expand_dims(mask, -1), dtype), tf.shape(inputs))
            return tf.reduce_sum(weights) / tf.cast(tf.shape(inputs)[self.axis], dtype)
        shape = tf.shape(inputs)
        return tf.cast(tf.reduce_prod(tf.gather(shape, self._reduction_axes)), dtype)
