"""A custom TensorFlow 2 training loop on scikit-learn's digits with
hvdlite.tensorflow: DistributedGradientTape, and broadcast_variables on the first
step inside tf.function (Horovod's TF2 pattern, with its import line changed).

    mpiexec -n 2 python examples/tensorflow_digits_tape.py
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

import hvdlite.tensorflow as hvd  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.02, help="per rank; scaled by size")
    args = parser.parse_args()

    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[..., None]
    x_train, x_test, y_train, y_test = train_test_split(
        images, digits.target, test_size=0.25, random_state=0, stratify=digits.target)
    train = (tf.data.Dataset.from_tensor_slices((x_train, y_train))
             .shard(hvd.size(), hvd.rank()).shuffle(2000, seed=0).batch(args.batch_size))
    steps = min(hvd.allgather_object(int(train.cardinality())))   # same count everywhere

    model = keras.Sequential([
        keras.layers.Input((8, 8, 1)),
        keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(2),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10),
    ])
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    optimizer = keras.optimizers.SGD(args.lr * hvd.size(), momentum=0.9)

    @tf.function
    def training_step(images: tf.Tensor, labels: tf.Tensor, first_batch: bool) -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(images, training=True))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        # After the first step, so that the optimizer's variables exist too.
        if first_batch:
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(optimizer.variables, root_rank=0)
        return loss

    for epoch in range(args.epochs):
        for batch, (images, labels) in enumerate(train.take(steps)):
            loss = training_step(images, labels, epoch == 0 and batch == 0)
        average = hvd.allreduce(loss, name="epoch.loss")
        if hvd.rank() == 0:
            print(f"epoch {epoch + 1}: loss {float(average):.4f}")

    mine = slice(hvd.rank(), None, hvd.size())
    predicted = np.argmax(model(x_test[mine]).numpy(), axis=1)
    counts = hvd.allreduce(tf.constant([np.sum(predicted == y_test[mine]), len(predicted)],
                                       tf.float64), op=hvd.Sum, name="accuracy.counts")
    if hvd.rank() == 0:
        print(f"test accuracy: {float(counts[0] / counts[1]):.4f} on {hvd.size()} ranks")


if __name__ == "__main__":
    main()
