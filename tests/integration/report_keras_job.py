"""A Keras 3 model.fit run (TensorFlow backend, compiled train step) for the
HVDLITE_REPORT tests: rank REPORT_SLOW_RANK's data loading (a tf.data map that
sleeps) is slower; the report must see every step through the optimizer."""
from __future__ import annotations

import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import hvdlite.keras as hvd  # noqa: E402


def main() -> None:
    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    steps = int(os.environ.get("REPORT_STEPS", "25"))
    slow = int(os.environ.get("REPORT_SLOW_RANK", "-1"))
    delay = float(os.environ.get("REPORT_EXTRA_SLEEP", "0.08")) if hvd.rank() == slow else 0.0

    def load(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        time.sleep(0.02 + delay)       # data loading
        return x, y
    rng = np.random.default_rng(hvd.rank())
    x, y = rng.standard_normal((steps * 16, 32)).astype("float32"), rng.integers(0, 4, steps * 16)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(16).map(
        lambda a, b: tf.numpy_function(load, [a, b], [tf.float32, tf.int64]))
    data = data.map(lambda a, b: (tf.ensure_shape(a, [None, 32]), tf.ensure_shape(b, [None])))
    model = keras.Sequential([keras.layers.Input((32,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(4)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(data, epochs=1, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    hvd.shutdown()


if __name__ == "__main__":
    main()
