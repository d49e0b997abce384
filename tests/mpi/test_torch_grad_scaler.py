"""torch.amp.GradScaler with hvdlite.torch's DistributedOptimizer, as Horovod's docs
use it (``synchronize(); scaler.unscale_(optimizer); clip; with skip_synchronize():
scaler.step(optimizer); scaler.update()``): the scaler looks for inf and nan in the
gradients after they are averaged, so when one rank's batch overflows every rank
skips that step and every rank's loss scale stays the same. The parameters match one
process that trains on every rank's batch and skips the same step."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import hvdlite.torch as hvd  # noqa: E402
from tests.mpi.conftest import assert_identical_everywhere  # noqa: E402

STEPS, OVERFLOWING_STEP = 5, 2


def _batch(rank: int, step: int) -> "torch.Tensor":
    """Rank ``rank``'s batch; on the last rank one value of one step is inf."""
    x = torch.linspace(-1.0, 1.0, 12).reshape(3, 4) * (rank + 1) + step
    if step == OVERFLOWING_STEP and rank == hvd.size() - 1:
        x[1, 2] = float("inf")
    return x


def _model() -> "torch.nn.Module":
    torch.manual_seed(0)
    return torch.nn.Linear(4, 2)


def _one_process() -> list:
    """Every rank's batch in one process; the overflowing step is skipped."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(STEPS):
        if step == OVERFLOWING_STEP:
            continue
        optimizer.zero_grad()
        losses = [model(_batch(r, step)).pow(2).mean() for r in range(hvd.size())]
        (sum(losses) / hvd.size()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    return [p.detach().numpy() for p in model.parameters()]


def test_one_ranks_overflow_skips_the_step_on_every_rank() -> None:
    model = _model()
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        named_parameters=model.named_parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=2)
    scales, skipped = [], []
    for step in range(STEPS):
        before = [p.detach().clone() for p in model.parameters()]
        optimizer.zero_grad()
        scaler.scale(model(_batch(hvd.rank(), step)).pow(2).mean()).backward()
        optimizer.synchronize()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with optimizer.skip_synchronize():
            scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
        skipped.append(all(torch.equal(a, p) for a, p in zip(before, model.parameters())))
    parameters = [p.detach().numpy() for p in model.parameters()]
    assert_identical_everywhere(parameters + [np.array(scales)])
    assert skipped == [step == OVERFLOWING_STEP for step in range(STEPS)]
    # growth_interval=2: doubled after two finite steps, halved at the skipped one
    assert scales == [256.0, 512.0, 256.0, 256.0, 512.0]
    for mine, expected in zip(parameters, _one_process()):
        np.testing.assert_allclose(mine, expected, rtol=0, atol=1e-6)
