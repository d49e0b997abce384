"""DistributedGradientTape training equivalence: N ranks, each on 1/N of every
batch, inside tf.function, reach the weights of one process trained on the whole
batch, and hold bitwise-identical copies."""
from __future__ import annotations

import os
from typing import Callable, Optional

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import pytest  # noqa: E402

tf = pytest.importorskip(
    "tensorflow", reason="TensorFlow is not installed in this venv (make test's Open MPI venv, .venv-ompi, has NumPy and torch only)")
tf.config.threading.set_intra_op_parallelism_threads(1)
keras = tf.keras

import hvdlite.tensorflow as hvd  # noqa: E402
from tests.mpi.conftest import assert_identical_everywhere, keras_optimizers  # noqa: E402

PER_RANK = 6
TOLERANCE = 1e-10      # float64 model: only the summation order differs
STEPS = 12


def _weights(seed: int) -> list:
    rng = np.random.default_rng(seed)
    return [tf.Variable(rng.normal(size=shape)) for shape in ((5, 16), (16,), (16, 3), (3,))]


def _batch(step: int) -> tuple:
    rng = np.random.default_rng(10_000 + step)
    total = PER_RANK * hvd.size()
    return rng.normal(size=(total, 5)), rng.normal(size=(total, 3))


def _shard(array: np.ndarray) -> np.ndarray:
    return array[hvd.rank() * PER_RANK:(hvd.rank() + 1) * PER_RANK]


def _loss(w: list, x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
    hidden = tf.tanh(x @ w[0] + w[1])
    return tf.reduce_mean((hidden @ w[2] + w[3] - y) ** 2)


def _train(make_opt: Callable, distributed: bool) -> list:
    # Different initial weights per rank: broadcast_variables on the first step fixes them.
    w = _weights(1234 + (hvd.rank() if distributed else 0))
    optimizer = make_opt()

    @tf.function
    def step(x: tf.Tensor, y: tf.Tensor, first: bool) -> None:
        if distributed and first:      # inside tf.function, on the first step
            hvd.broadcast_variables(w, root_rank=0)
        with tf.GradientTape() as tape:
            loss = _loss(w, x, y)
        if distributed:
            tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, w)
        optimizer.apply_gradients(zip(grads, w))
        if distributed and first:      # the optimizer's variables exist from here on
            hvd.broadcast_variables(optimizer.variables, root_rank=0)

    for number in range(STEPS):
        x, y = _batch(number)
        if distributed:
            x, y = _shard(x), _shard(y)
        step(tf.constant(x), tf.constant(y), number == 0)
    return [v.numpy() for v in w]


_assert_identical_everywhere = assert_identical_everywhere
OPTIMIZERS = keras_optimizers(keras)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_tape_in_tf_function_matches_one_process(name: str) -> None:
    distributed = _train(OPTIMIZERS[name], True)
    # The reference starts from rank 0's weights, which the broadcast spread.
    reference = _train(OPTIMIZERS[name], False)
    for got, want in zip(distributed, reference):
        np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE)
    _assert_identical_everywhere(distributed)


def _embedding_grads(sparse_as_dense: Optional[bool]) -> tf.Tensor:
    table = tf.Variable(np.arange(12.0).reshape(6, 2))

    @tf.function
    def step() -> tf.Tensor:
        with tf.GradientTape() as tape:
            rows = tf.gather(table, [hvd.rank(), hvd.rank() + 1])
            loss = tf.reduce_sum(rows) * (hvd.rank() + 1)
        settings = {} if sparse_as_dense is None else {"sparse_as_dense": sparse_as_dense}
        tape = hvd.DistributedGradientTape(tape, **settings)
        grad = tape.gradient(loss, [table])[0]
        assert isinstance(grad, tf.IndexedSlices) != bool(sparse_as_dense)   # default: sparse
        return tf.convert_to_tensor(grad)
    return step().numpy()


def test_indexed_slices_gradients_both_ways() -> None:
    n = hvd.size()
    expected = np.zeros((6, 2))
    for k in range(n):
        expected[[k, k + 1]] += (k + 1) / n
    for sparse_as_dense in (False, True, None):
        np.testing.assert_allclose(_embedding_grads(sparse_as_dense), expected)


def test_groups_and_num_groups_reach_the_averager() -> None:
    # Horovod's num_groups means groups=num_groups; an explicit groups wins.
    a, b = tf.Variable([1.0]), tf.Variable([2.0])
    assert hvd.DistributedGradientTape(tf.GradientTape())._averager.groups is None
    assert hvd.DistributedGradientTape(tf.GradientTape(), num_groups=2)._averager.groups == 2
    explicit = [[a], [b]]
    tape = hvd.DistributedGradientTape(tf.GradientTape(), groups=explicit, num_groups=3)
    assert tape._averager.groups is explicit
    with tf.GradientTape() as inner:
        loss = (hvd.rank() + 1.0) * (a[0] + 2.0 * b[0])
    grads = hvd.DistributedGradientTape(inner, num_groups=2).gradient(loss, [a, b])
    mean = (hvd.size() + 1) / 2.0
    np.testing.assert_allclose([g.numpy()[0] for g in grads], [mean, 2.0 * mean])


def test_tape_mismatched_variables_raise_everywhere() -> None:
    w = tf.Variable(tf.ones([2 + hvd.rank()]), name="uneven")
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(w * w)
    with pytest.raises(hvd.MismatchError, match="uneven"):
        hvd.DistributedGradientTape(tape).gradient(loss, [w])


def test_tape_gradient_predivide_factor_gives_the_average() -> None:
    w = _weights(1234)
    x, y = (tf.constant(_shard(a)) for a in _batch(0))
    reduced = {}
    for factor in (1.0, 4.0):
        with tf.GradientTape() as tape:
            loss = _loss(w, x, y)
        tape = hvd.DistributedGradientTape(tape, gradient_predivide_factor=factor)
        reduced[factor] = [g.numpy() for g in tape.gradient(loss, w)]
    with tf.GradientTape() as tape:
        loss = _loss(w, *(tf.constant(a) for a in _batch(0)))
    whole = [g.numpy() for g in tape.gradient(loss, w)]
    for plain, divided, want in zip(reduced[1.0], reduced[4.0], whole):
        np.testing.assert_allclose(divided, plain, rtol=1e-12, atol=0)
        np.testing.assert_allclose(divided, want, rtol=0, atol=TOLERANCE)


def test_one_rank_set_reduces_nothing() -> None:
    """On a process set of one rank the averaged gradient is the gradient itself: the
    averager hands back the same tensors (no collective in the step), as the torch
    optimizer does; a larger set still reduces."""
    from hvdlite.tensorflow.gradients import GradientAverager
    singles = [hvd.add_process_set([r]) for r in range(hvd.size())]
    try:
        mine = singles[hvd.rank()]
        variable = tf.Variable(tf.ones(3))
        grad = tf.constant([1.0, 2.0, 3.0]) * (hvd.rank() + 1)
        assert GradientAverager("alone", process_set=mine)([grad], [variable])[0] is grad
        everyone = GradientAverager("everyone")([grad], [variable])[0]
        np.testing.assert_allclose(everyone.numpy(), np.array([1.0, 2.0, 3.0]) *
                                   sum(r + 1 for r in range(hvd.size())) / hvd.size())
    finally:
        for single in singles:
            hvd.remove_process_set(single)


def test_gradients_and_variables_must_pair_up() -> None:
    a, b = tf.Variable([1.0]), tf.Variable([2.0])
    averager = hvd.DistributedGradientTape(tf.GradientTape())._averager
    for grads in ([tf.ones([1])], [tf.ones([1])] * 3):      # too few, too many: refused here
        with pytest.raises(hvd.UsageError, match=f"{len(grads)} gradients for 2 variables"):
            averager(grads, [a, b])
    # Past CPython's shared small ints, equal counts are still equal.
    many = [tf.Variable([float(i)]) for i in range(300)]
    averaged = averager([tf.ones([1])] * 300, many)
    np.testing.assert_array_equal(np.concatenate([g.numpy() for g in averaged]), np.ones(300))

