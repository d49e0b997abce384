"""Synthetic-data model.fit throughput with Keras 3 and hvdlite.keras, with the
command line of Horovod's tensorflow2_keras_synthetic_benchmark.py. ``--model``
is ``mlp``, ``cnn`` (defined here, CPU-sized) or a keras.applications name
(built with weights=None: nothing is downloaded).

    mpiexec -n 2 python examples/keras_synthetic_benchmark.py --model mlp
"""
from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import hvdlite.keras as hvd  # noqa: E402


def build(name: str) -> tuple[keras.Model, tuple[int, ...]]:
    """A model and its per-sample input shape (1000 classes, as Horovod's)."""
    if name == "mlp":
        return keras.Sequential([keras.layers.Input((784,)),
                                 keras.layers.Dense(1024, activation="relu"),
                                 keras.layers.Dense(1024, activation="relu"),
                                 keras.layers.Dense(1000)]), (784,)
    if name == "cnn":
        return keras.Sequential([keras.layers.Input((32, 32, 3)),
                                 keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
                                 keras.layers.MaxPooling2D(2),
                                 keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
                                 keras.layers.MaxPooling2D(2), keras.layers.Flatten(),
                                 keras.layers.Dense(1000)]), (32, 32, 3)
    return getattr(keras.applications, name)(weights=None), (224, 224, 3)


class _Timer(keras.callbacks.Callback):
    """Seconds per iteration of ``batches`` steps, after the warmup steps."""

    def __init__(self, warmup: int, batches: int) -> None:
        super().__init__()
        self.warmup, self.batches, self.times, self._start = warmup, batches, [], 0.0

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        done = batch - self.warmup
        if done >= 0 and done % self.batches == 0:
            now = time.perf_counter()
            if done:
                self.times.append(now - self._start)
            self._start = now


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fp16-allreduce", action="store_true", default=False)
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--num-warmup-batches", type=int, default=5)
    parser.add_argument("--num-batches-per-iter", type=int, default=10)
    parser.add_argument("--num-iters", type=int, default=5)
    args = parser.parse_args()

    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    model, shape = build(args.model)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01),
                                                     compression=compression),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(hvd.rank())
    data = rng.random((args.batch_size,) + shape, dtype=np.float32)
    target = rng.integers(0, 1000, size=(args.batch_size,))
    dataset = tf.data.Dataset.from_tensors((data, target)).repeat()
    steps = args.num_warmup_batches + args.num_batches_per_iter * args.num_iters + 1
    timer = _Timer(args.num_warmup_batches, args.num_batches_per_iter)
    model.fit(dataset, steps_per_epoch=steps, epochs=1, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), timer])

    rates = [args.batch_size * args.num_batches_per_iter / t for t in timer.times]
    mean = float(np.mean(rates))
    total = float(hvd.allreduce(tf.constant(mean, tf.float64), op=hvd.Sum, name="img_sec"))
    if hvd.rank() == 0:
        print(f"Model: {args.model}, batch size: {args.batch_size}, ranks: {hvd.size()}")
        print(f"Img/sec per rank: {mean:.1f} +- {1.96 * float(np.std(rates)):.1f}")
        print(f"Total img/sec on {hvd.size()} rank(s): {total:.1f}")


if __name__ == "__main__":
    main()
