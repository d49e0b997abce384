"""Data-parallel training of a small CNN on scikit-learn's bundled digits data
set (8x8 images, no download) with Keras 3 and hvdlite.keras.

    mpiexec -n 2 python examples/keras_digits.py

A Horovod Keras script with its import line changed: init, shard the tf.data
pipeline by rank, scale the learning rate by the number of ranks (warmed up
gradually), wrap the optimizer, broadcast rank 0's initial state, average the
logged metrics, and show Keras' progress bar on rank 0 only.
"""
from __future__ import annotations

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import hvdlite.keras as hvd  # noqa: E402


def model() -> keras.Model:
    return keras.Sequential([
        keras.layers.Input((8, 8, 1)),
        keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(2),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10),
    ])


def datasets(seed: int, batch_size: int) -> tuple[tf.data.Dataset, tuple]:
    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[..., None]
    x_train, x_test, y_train, y_test = train_test_split(
        images, digits.target, test_size=0.25, random_state=seed, stratify=digits.target)
    train = (tf.data.Dataset.from_tensor_slices((x_train, y_train))
             .shard(hvd.size(), hvd.rank())          # this rank's 1/size of the data
             .shuffle(len(x_train), seed=seed, reshuffle_each_iteration=True)
             .batch(batch_size))
    return train, (x_test, y_test)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.02, help="per rank; scaled by size")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)   # one core per rank
    keras.utils.set_random_seed(args.seed + hvd.rank())       # rank 0's weights win below
    train, (x_test, y_test) = datasets(args.seed, args.batch_size)
    # Every rank must take the same number of steps: use the smallest shard's.
    steps = min(hvd.allgather_object(int(train.cardinality())))

    lr = args.lr * hvd.size()
    net = model()
    net.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(lr, momentum=0.9)),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["accuracy"])
    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),
        hvd.callbacks.LearningRateWarmupCallback(lr, warmup_epochs=3, steps_per_epoch=steps,
                                                 verbose=1),
    ]
    net.fit(train.repeat(), steps_per_epoch=steps, epochs=args.epochs, callbacks=callbacks,
            verbose=1 if hvd.rank() == 0 else 0)

    # Each rank scores its own slice of the test set; the counts are summed.
    mine = slice(hvd.rank(), None, hvd.size())
    predicted = np.argmax(net.predict(x_test[mine], verbose=0), axis=1)
    counts = hvd.allreduce(tf.constant([np.sum(predicted == y_test[mine]), len(predicted)],
                                       dtype=tf.float64), op=hvd.Sum, name="accuracy.counts")
    if hvd.rank() == 0:
        print(f"test accuracy: {float(counts[0] / counts[1]):.4f} on {hvd.size()} ranks")


if __name__ == "__main__":
    main()
