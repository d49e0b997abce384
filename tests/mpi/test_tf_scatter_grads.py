"""Gradients of hvdlite.tensorflow's alltoall, reducescatter and
grouped_reducescatter, eager and inside tf.function, with Horovod's conventions:
alltoall sends each received row's gradient back to the rank it came from;
reducescatter's gradient is the allgather of the gradient, times the set size
for Sum and unscaled for Average (then the scale factors)."""
from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import pytest  # noqa: E402

tf = pytest.importorskip("tensorflow")
tf.config.threading.set_intra_op_parallelism_threads(1)

import hvdlite.tensorflow as hvd  # noqa: E402

MODES = ["eager", "function"]


def _mode(fn, mode: str):  # type: ignore[no-untyped-def]
    return fn if mode == "eager" else tf.function(fn)


def _rows(rank: int, count: int) -> np.ndarray:
    return np.arange(count * 2, dtype=np.float32).reshape(count, 2) + 100 * rank


def _weights(received: tf.Tensor) -> tf.Tensor:
    """This rank's loss weight, rank + 1: the gradient reaching a sender's rows
    then says which rank received them."""
    return tf.cast(hvd.rank() + 1, received.dtype)


@pytest.mark.parametrize("mode", MODES)
def test_alltoall_gradient_returns_along_the_received_splits(mode: str) -> None:
    r, n = hvd.rank(), hvd.size()
    splits = [(r + k) % 2 + 1 for k in range(n)]   # 1 or 2 rows to each rank
    x = tf.constant(_rows(r, sum(splits)))

    def step(t):  # type: ignore[no-untyped-def]
        with tf.GradientTape() as tape:
            tape.watch(t)
            received, received_splits = hvd.alltoall(t, splits=splits)
            loss = tf.reduce_sum(received * _weights(received))
        return received, received_splits, tape.gradient(loss, t)
    received, received_splits, grad = _mode(step, mode)(x)
    np.testing.assert_array_equal(received_splits.numpy(), [(k + r) % 2 + 1 for k in range(n)])
    assert received_splits.dtype == tf.int32
    expected = np.repeat(np.arange(1, n + 1, dtype=np.float32), splits)[:, None] * np.ones(2)
    np.testing.assert_array_equal(grad.numpy(), expected)


@pytest.mark.parametrize("mode", MODES)
def test_alltoall_even_split_gradient(mode: str) -> None:
    r, n = hvd.rank(), hvd.size()
    x = tf.constant(_rows(r, 2 * n))

    def step(t):  # type: ignore[no-untyped-def]
        with tf.GradientTape() as tape:
            tape.watch(t)
            received = hvd.alltoall(t)
            loss = tf.reduce_sum(received * _weights(received))
        return received, tape.gradient(loss, t)
    received, grad = _mode(step, mode)(x)
    np.testing.assert_array_equal(received.numpy(), np.concatenate(
        [_rows(k, 2 * n)[2 * r:2 * r + 2] for k in range(n)]))
    expected = np.repeat(np.arange(1, n + 1, dtype=np.float32), 2)[:, None] * np.ones(2)
    np.testing.assert_array_equal(grad.numpy(), expected)


def _blocks(rows: int, n: int) -> list[int]:
    """Rows each rank keeps from a reducescatter: the first rows % n get one more."""
    return [rows // n + (1 if k < rows % n else 0) for k in range(n)]


CASES = [("Sum", {}, lambda n: n), ("Average", {}, lambda n: 1),
         ("Sum", {"prescale_factor": 0.5, "postscale_factor": 3.0}, lambda n: 1.5 * n),
         ("Average", {"postscale_factor": 2.0}, lambda n: 2.0)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("op_name,factors,scale", CASES)
def test_reducescatter_gradient_is_the_scaled_allgather(mode: str, op_name: str, factors: dict,
                                                        scale) -> None:  # type: ignore[no-untyped-def]
    r, n = hvd.rank(), hvd.size()
    op = getattr(hvd, op_name)
    rows = 2 * n + 1    # uneven: the first rank keeps one row more
    x = tf.constant(_rows(r, rows))

    def step(t):  # type: ignore[no-untyped-def]
        with tf.GradientTape() as tape:
            tape.watch(t)
            out = hvd.reducescatter(t, op=op, **factors)
            loss = tf.reduce_sum(out * _weights(out))
        return out, tape.gradient(loss, t)
    out, grad = _mode(step, mode)(x)
    blocks = _blocks(rows, n)
    start = sum(blocks[:r])
    total = sum(_rows(k, rows) for k in range(n)) * factors.get("prescale_factor", 1.0)
    total = total / (n if op_name == "Average" else 1) * factors.get("postscale_factor", 1.0)
    np.testing.assert_allclose(out.numpy(), total[start:start + blocks[r]], rtol=1e-6)
    expected = np.repeat(np.arange(1, n + 1, dtype=np.float32), blocks)[:, None] * np.ones(2)
    np.testing.assert_allclose(grad.numpy(), expected * scale(n), rtol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_grouped_reducescatter_gradient_per_tensor(mode: str) -> None:
    r, n = hvd.rank(), hvd.size()
    a, b = tf.constant(_rows(r, 2 * n)), tf.constant(_rows(r, n + 1)[:, :1])

    def step(x, y):  # type: ignore[no-untyped-def]
        with tf.GradientTape() as tape:
            tape.watch([x, y])
            outs = hvd.grouped_reducescatter([x, y], op=hvd.Sum)
            loss = tf.reduce_sum(outs[0] * _weights(outs[0])) + 10 * tf.reduce_sum(outs[1])
        return tape.gradient(loss, [x, y])
    grad_a, grad_b = _mode(step, mode)(a, b)
    weights = np.arange(1, n + 1, dtype=np.float32)
    np.testing.assert_array_equal(grad_a.numpy(),
                                  n * np.repeat(weights, 2)[:, None] * np.ones(2))
    np.testing.assert_array_equal(grad_b.numpy(), np.full((n + 1, 1), 10.0 * n))


@pytest.mark.parametrize("mode", MODES)
def test_reducescatter_gradient_of_other_ops_is_a_usage_error(mode: str) -> None:
    x = tf.constant(_rows(hvd.rank(), 2 * hvd.size()))

    def step(t):  # type: ignore[no-untyped-def]
        with tf.GradientTape() as tape:
            tape.watch(t)
            loss = tf.reduce_sum(hvd.reducescatter(t, op=hvd.Max))
        return tape.gradient(loss, t)
    with pytest.raises(hvd.UsageError, match="op=Average or Sum"):
        _mode(step, mode)(x)


def test_gradient_reaches_a_variable_through_both_ops() -> None:
    """A tf.Variable's gradient through alltoall then reducescatter (Average)."""
    r, n = hvd.rank(), hvd.size()
    variable = tf.Variable(_rows(r, 2 * n))
    with tf.GradientTape() as tape:
        exchanged = hvd.alltoall(variable)
        loss = tf.reduce_sum(hvd.reducescatter(exchanged, op=hvd.Average))
    grad = tape.gradient(loss, variable)
    np.testing.assert_array_equal(grad.numpy(), np.ones((2 * n, 2)))
