"""hvdlite.tensorflow's worker-local sources (register_local_source,
PartialDistributedGradientTape: a model-parallel layer that differs across ranks),
SyncBatchNormalization against BatchNormalization on the global batch (values,
moving statistics and input gradients, with unequal batches), and
hvdlite.tensorflow.DistributedOptimizer."""
from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import pytest  # noqa: E402

tf = pytest.importorskip(
    "tensorflow", reason="TensorFlow is not installed in this venv (make test's Open MPI venv, "
    ".venv-ompi, has NumPy and torch only)")
tf.config.threading.set_intra_op_parallelism_threads(1)
keras = pytest.importorskip("keras")
if keras.backend.backend() != "tensorflow":
    pytest.skip("these tests run Keras on the TensorFlow backend", allow_module_level=True)

import hvdlite.tensorflow as hvd  # noqa: E402


def _model_parallel() -> tuple[keras.layers.Layer, keras.layers.Layer]:
    """An embedding whose vocabulary differs by rank (each rank holds its own
    shard) and a dense layer every rank shares."""
    embedding = keras.layers.Embedding(5 + hvd.rank(), 3,
                                       embeddings_initializer=keras.initializers.Constant(1.0))
    dense = keras.layers.Dense(1, use_bias=False,
                               kernel_initializer=keras.initializers.Constant(0.5))
    embedding.build((None,))
    dense.build((None, 3))
    return embedding, dense


@pytest.mark.parametrize("how", ["register_local_source", "local_layers"])
@pytest.mark.parametrize("scale", [True, False])
def test_local_sources_keep_their_own_gradient(how: str, scale: bool) -> None:
    embedding, dense = _model_parallel()
    ids = tf.constant([0, 1 + hvd.rank()])
    variables = [embedding.embeddings, dense.kernel]

    @tf.function
    def step():  # type: ignore[no-untyped-def]
        with tf.GradientTape() as plain_tape:
            loss = tf.reduce_sum(dense(embedding(ids))) * (hvd.rank() + 1)
        plain = plain_tape.gradient(loss, variables)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(dense(embedding(ids))) * (hvd.rank() + 1)
        if how == "local_layers":
            tape = hvd.PartialDistributedGradientTape(tape, local_layers=[embedding],
                                                      scale_local_gradients=scale)
        else:
            tape = hvd.DistributedGradientTape(tape, scale_local_gradients=scale)
            tape.register_local_source(embedding.embeddings)
        local, shared = tape.get_local_and_global_gradients(loss, variables)
        return plain, [g for _, g in local], [g for _, g in shared]
    plain, local, shared = step()
    divide = hvd.size() if scale else 1
    np.testing.assert_allclose(tf.convert_to_tensor(local[0]).numpy(),
                               tf.convert_to_tensor(plain[0]).numpy() / divide, rtol=1e-6)
    every = hvd.allgather_object(plain[1].numpy())
    np.testing.assert_allclose(shared[0].numpy(), np.mean(every, axis=0), rtol=1e-6)


def _rows(rank: int) -> np.ndarray:
    """Rank r's batch: r + 2 rows of 3 channels (the ranks' batches differ in size)."""
    rng = np.random.default_rng(rank)
    return rng.normal(loc=rank, size=(rank + 2, 3)).astype(np.float64)


def _weights(rank: int) -> np.ndarray:
    return np.random.default_rng(50 + rank).normal(size=(rank + 2, 3))


def test_sync_batch_norm_is_batch_norm_on_the_global_batch() -> None:
    r, n = hvd.rank(), hvd.size()
    sync = hvd.SyncBatchNormalization(momentum=0.5, dtype="float64")
    plain = keras.layers.BatchNormalization(momentum=0.5, dtype="float64")
    mine = tf.constant(_rows(r))
    everything = tf.constant(np.concatenate([_rows(k) for k in range(n)]))
    start = sum(k + 2 for k in range(r))

    @tf.function
    def sync_step(x):  # type: ignore[no-untyped-def]
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = sync(x, training=True)
            loss = tf.reduce_sum(y * _weights(r))
        return y, tape.gradient(loss, x)

    with tf.GradientTape() as tape:
        tape.watch(everything)
        want = plain(everything, training=True)
        loss = tf.reduce_sum(want * np.concatenate([_weights(k) for k in range(n)]))
    want_grad = tape.gradient(loss, everything)[start:start + r + 2]
    got, got_grad = sync_step(mine)
    np.testing.assert_allclose(got.numpy(), want.numpy()[start:start + r + 2], atol=1e-12)
    np.testing.assert_allclose(got_grad.numpy(), want_grad.numpy(), atol=1e-10)
    for a, b in ((sync.moving_mean, plain.moving_mean),
                 (sync.moving_variance, plain.moving_variance)):
        np.testing.assert_allclose(keras.ops.convert_to_numpy(a),
                                   keras.ops.convert_to_numpy(b), atol=1e-12)
    with pytest.raises(hvd.UsageError, match="fused=True"):
        hvd.SyncBatchNormalization(fused=True)


def test_tensorflow_distributed_optimizer_wraps_keras_optimizers_only() -> None:
    wrapped = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=2)
    assert type(wrapped).__name__ == "SGD" and type(wrapped)._hvdlite.passes == 2
    with pytest.raises(TypeError, match="TF1 graph-mode optimizers"):
        hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1))


def test_tape_on_a_process_set_leaves_non_members_their_own_gradient() -> None:
    evens = hvd.add_process_set([r for r in range(hvd.size()) if r % 2 == 0])
    try:
        x = tf.constant(float(hvd.rank()))
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = x * x
        grad, = hvd.DistributedGradientTape(tape, process_set=evens).gradient(y, [x])
        want = 2.0 * (sum(evens.ranks) / evens.size() if evens.included() else hvd.rank())
        assert float(grad) == pytest.approx(want)
    finally:
        hvd.remove_process_set(evens)
