"""DistributedGradientTape with gradients that are None: a branch no rank uses on some
steps comes back None (Adam leaves it alone, as in one process), one some ranks use is
averaged with zeros from the others; eagerly and inside tf.function. N ranks on 1/N of
every batch reach one process's weights on the whole batch (float64, TOLERANCE) and
hold bitwise-identical copies."""
from __future__ import annotations

import os
from typing import Callable

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import pytest  # noqa: E402

tf = pytest.importorskip(
    "tensorflow", reason="TensorFlow is not installed in this venv (make test's Open MPI venv, .venv-ompi, has NumPy and torch only)")
tf.config.threading.set_intra_op_parallelism_threads(1)
keras = tf.keras

import hvdlite.tensorflow as hvd  # noqa: E402
from tests.mpi.conftest import assert_identical_everywhere  # noqa: E402
from tests.mpi.test_tf_tape import PER_RANK, TOLERANCE, _batch, _shard  # noqa: E402

STEPS = 8
Uses = Callable[[int, int], bool]      # (step, rank): the branch is used


def _weights() -> list:
    rng = np.random.default_rng(1234)
    return [tf.Variable(rng.normal(size=shape))
            for shape in ((5, 16), (16,), (16, 3), (3,), (16, 3))]     # the last: a branch


def _train(uses: Uses, distributed: bool, traced: bool) -> tuple[list, list]:
    """The weights, and for each step whether the branch's gradient was None."""
    w = _weights()
    optimizer = keras.optimizers.Adam(0.01)

    def step(x: tf.Tensor, y: tf.Tensor, mask: tf.Tensor, use: bool) -> bool:
        with tf.GradientTape() as tape:
            hidden = tf.tanh(x @ w[0] + w[1])
            out = hidden @ w[2] + w[3]
            if use:
                out = out + mask[:, None] * (hidden @ w[4])
            loss = tf.reduce_mean((out - y) ** 2)
        if distributed:
            tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, w)
        optimizer.apply_gradients([(g, v) for g, v in zip(grads, w) if g is not None])
        return grads[4] is None

    run = tf.function(step) if traced else step
    missing = []
    for number in range(STEPS):
        x, y = _batch(number)
        ranks = [r for r in range(hvd.size()) if uses(number, r)]
        mask = np.zeros(len(x))
        for r in ranks:
            mask[r * PER_RANK:(r + 1) * PER_RANK] = 1
        if distributed:
            x, y, mask = _shard(x), _shard(y), _shard(mask[:, None])[:, 0]
            use = hvd.rank() in ranks
        else:
            use = bool(ranks)
        missing.append(bool(run(tf.constant(x), tf.constant(y), tf.constant(mask), use)))
    return [v.numpy() for v in w], missing


def _assert_matches_one_process(uses: Uses, traced: bool) -> list:
    distributed, missing = _train(uses, True, traced)
    reference, expected = _train(uses, False, traced)
    for got, want in zip(distributed, reference):
        np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE)
    assert_identical_everywhere(distributed)
    assert missing == expected
    return missing


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf_function"])
def test_a_branch_no_rank_uses_on_some_steps_stays_none(traced: bool) -> None:
    missing = _assert_matches_one_process(lambda step, rank: step % 3 == 0, traced)
    assert missing == [step % 3 != 0 for step in range(STEPS)]


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf_function"])
def test_a_branch_rank_0_uses_is_averaged_with_zeros_everywhere(traced: bool) -> None:
    """Inside tf.function each rank traces its own step once (rank 0 with the branch,
    the others without); the ranks agree which gradients exist when they trace."""
    missing = _assert_matches_one_process(lambda step, rank: rank == 0, traced)
    assert missing == [False] * STEPS


def test_eagerly_which_ranks_use_a_branch_may_change_every_step() -> None:
    _assert_matches_one_process(lambda step, rank: (step + rank) % 3 == 0, traced=False)
