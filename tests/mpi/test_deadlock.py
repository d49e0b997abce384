"""A deadlock (every rank blocked in hvdlite on tensors another rank has not
submitted, none free to submit them) is a DeadlockError on every rank within
HVDLITE_STALL_CHECK_TIME, naming each rank's pending tensors and the likely cause;
a rank that is merely slow still only draws the stall warning.
Keras fit: test_deadlock_keras.py; a TensorFlow loop: test_deadlock_tf.py."""
from __future__ import annotations

import time
from typing import Optional

import numpy as np
import pytest

import hvdlite as hvd
from tests.mpi.deadlock_case import (BATCH, STALL_CHECK_S, Warnings, check_deadlock,
                                     first_error, recovered, shard)
from tests.mpi.deadlock_case import short_stall_check  # noqa: F401  (fixture)

pytestmark = pytest.mark.timeout(60)


def _needs_two() -> None:
    if hvd.size() < 2:
        pytest.skip("needs two ranks")


def test_a_torch_loop_over_uneven_shards(short_stall_check: Warnings) -> None:
    """Rank 0 runs out of batches and averages its epoch loss while the others wait
    on the next step's gradients."""
    _needs_two()
    torch = pytest.importorskip("torch")
    import hvdlite.torch as hvd_torch
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 1)
    optimizer = hvd_torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                               named_parameters=model.named_parameters())
    hvd_torch.broadcast_parameters(model.state_dict(), root_rank=0)
    x, y = (torch.from_numpy(a) for a in shard(hvd.rank()))

    def train() -> None:
        for epoch in range(2):
            for start in range(0, len(x), BATCH):
                optimizer.zero_grad()
                loss = torch.nn.functional.mse_loss(model(x[start:start + BATCH]),
                                                    y[start:start + BATCH])
                loss.backward()
                optimizer.step()
            hvd_torch.allreduce(loss.detach(), name=f"torch.epoch.loss.{epoch}")
    error = first_error(train)
    after = recovered("torch")
    check_deadlock(error, after, {"rank 0": "torch.epoch.loss.0",
                                  "others": "DistributedOptimizer.bucket.0"})


def test_ranks_on_different_paths_while_one_is_joined(short_stall_check: Warnings) -> None:
    """Rank 0 has joined; each other rank waits on an allreduce of its own name: the
    joined rank is named as in join(), and is not counted missing from allreduces."""
    if hvd.size() < 3:
        pytest.skip("needs three ranks: with two, the one rank left runs its allreduce")
    error: Optional[BaseException] = None
    try:
        if hvd.rank() == 0:
            hvd.join()
        else:
            hvd.allreduce(np.ones(3), name=f"deadlock.path.{hvd.rank()}")
    except hvd.HvdliteError as caught:
        error = caught
    after = recovered("join")
    assert isinstance(error, hvd.DeadlockError), repr(error)
    text = str(error)
    assert "rank 0 is in join()" in text, text
    others = list(range(1, hvd.size()))
    for rank in others:
        missing = [r for r in others if r != rank]
        assert (f"rank {rank} waits on allreduce 'deadlock.path.{rank}' (not submitted by "
                f"ranks {missing})") in text, text
    np.testing.assert_array_equal(after, np.full(2, float(hvd.size())))


@pytest.mark.parametrize("pending", [False, True], ids=["idle", "with_async_op_pending"])
def test_a_slow_rank_only_draws_the_stall_warning(short_stall_check: Warnings,
                                                  pending: bool) -> None:
    """Rank 0 is busy (a long evaluation, outside hvdlite) for three stall check
    times while the others wait on 'slow.probe'; with ``pending`` it has submitted,
    and not yet waits on, an allreduce the others submit only later. No error: the
    stall is logged and the collectives complete."""
    _needs_two()
    name = f"slow.probe.{pending}"

    def early() -> Optional[int]:
        return hvd.allreduce_async(np.ones(2), op=hvd.Sum, name=f"{name}.early") if pending \
            else None
    if hvd.rank() == 0:
        handle = early()
        # Busy until the stall is logged (the others have waited a stall check time, twice
        # the deadlock's), and for one more: a deadlock wrongly seen would be raised by then.
        deadline = time.monotonic() + 60
        while not any(f"'{name}'" in m for m in short_stall_check.messages) \
                and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(STALL_CHECK_S)
        result = hvd.allreduce(np.full(2, 0.0), op=hvd.Sum, name=name)
    else:
        result = hvd.allreduce(np.full(2, float(hvd.rank())), op=hvd.Sum, name=name)
        handle = early()
    early_result = hvd.synchronize(handle) if handle is not None else None
    total = sum(range(hvd.size()))
    np.testing.assert_array_equal(result, np.full(2, float(total)))
    if pending:
        np.testing.assert_array_equal(early_result, np.full(2, float(hvd.size())))
    if hvd.rank() == 0:     # the coordinator logs stalls
        assert any(f"'{name}'" in m and "missing ranks: [0]" in m
                   for m in short_stall_check.messages), short_stall_check.messages
    assert not any("Deadlock" in m for m in short_stall_check.messages)
