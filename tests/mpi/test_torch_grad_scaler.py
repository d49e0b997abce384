"""torch.amp.GradScaler with hvdlite.torch's DistributedOptimizer, called as Horovod's
docs call it (``synchronize(); scaler.unscale_(optimizer); clip; with
skip_synchronize(): scaler.step(optimizer); scaler.update()``) and as torch's AMP
recipe does (``scaler.step(optimizer)`` straight after ``backward()``): either way the
scaler looks for inf and nan in the averaged gradients, so when one rank's batch
overflows every rank skips that step and every rank's loss scale stays the same. The
parameters match one process that trains on every rank's batch and skips the same
step (within 1e-6)."""
from __future__ import annotations

import warnings
from typing import Any, Callable

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import hvdlite.torch as hvd  # noqa: E402
from tests.mpi.conftest import assert_identical_everywhere  # noqa: E402

STEPS, OVERFLOWING_STEP = 5, 2
# growth_interval=2: doubled after two finite steps, halved at the skipped one
SCALES = [256.0, 512.0, 256.0, 256.0, 512.0]


def _batch(rank: int, step: int) -> "torch.Tensor":
    """Rank ``rank``'s batch; on the last rank one value of one step is inf."""
    x = torch.linspace(-1.0, 1.0, 12).reshape(3, 4) * (rank + 1) + step
    if step == OVERFLOWING_STEP and rank == hvd.size() - 1:
        x[1, 2] = float("inf")
    return x


class _Model(torch.nn.Module):
    """A layer every step uses, and a branch only rank 0 takes, on the step after the
    overflow (every rank takes part in its reduction: zeros from the others)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk, self.branch = torch.nn.Linear(4, 2), torch.nn.Linear(2, 2)

    def forward(self, x: "torch.Tensor", rank: int, step: int) -> "torch.Tensor":
        out = self.trunk(x)
        if rank == 0 and step == OVERFLOWING_STEP + 1:
            out = self.branch(out)
        return out.pow(2).mean()


def _sgd(model: "torch.nn.Module") -> Any:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _fused_adam(model: "torch.nn.Module") -> Any:
    """Adam's fused step unscales and skips by itself: the scaler hands it grad_scale
    and found_inf instead of unscaling (_step_supports_amp_scaling)."""
    return torch.optim.Adam(model.parameters(), lr=0.05, fused=True)


def _one_process(make_optimizer: Callable[[Any], Any], clip: bool) -> list:
    """Every rank's batch in one process; the overflowing step is skipped."""
    model = _Model()
    optimizer = make_optimizer(model)
    for step in range(STEPS):
        if step == OVERFLOWING_STEP:
            continue
        optimizer.zero_grad()
        losses = [model(_batch(r, step), r, step) for r in range(hvd.size())]
        (sum(losses) / hvd.size()).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    return [p.detach().numpy() for p in model.parameters()]


def _horovods_step(optimizer: Any, scaler: Any, model: Any) -> None:
    optimizer.synchronize()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with optimizer.skip_synchronize():
        scaler.step(optimizer)


def _torchs_step(optimizer: Any, scaler: Any, model: Any) -> None:
    scaler.step(optimizer)


def _train(make_optimizer: Callable[[Any], Any], recipe: Callable[..., None]) -> tuple:
    model = _Model()
    optimizer = hvd.DistributedOptimizer(make_optimizer(model),
                                         named_parameters=model.named_parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=2)
    if hvd.rank() == 0:     # asked outside a step, on one rank: no collective may start
        assert optimizer._step_supports_amp_scaling is (make_optimizer is _fused_adam)
    scales, skipped = [], []
    for step in range(STEPS):
        before = [p.detach().clone() for p in model.trunk.parameters()]
        optimizer.zero_grad()
        scaler.scale(model(_batch(hvd.rank(), step), hvd.rank(), step)).backward()
        recipe(optimizer, scaler, model)
        scaler.update()
        scales.append(scaler.get_scale())
        skipped.append(all(torch.equal(a, p) for a, p in zip(before, model.trunk.parameters())))
    return [p.detach().numpy() for p in model.parameters()], scales, skipped


@pytest.mark.parametrize("make_optimizer", [_sgd, _fused_adam], ids=["sgd", "fused_adam"])
@pytest.mark.parametrize("recipe", [_horovods_step, _torchs_step], ids=["horovod", "torch"])
def test_one_ranks_overflow_skips_the_step_on_every_rank(
        make_optimizer: Callable[[Any], Any], recipe: Callable[..., None]) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        parameters, scales, skipped = _train(make_optimizer, recipe)
    assert not [w for w in caught if "synchronize" in str(w.message)]
    assert_identical_everywhere(parameters + [np.array(scales)])
    assert skipped == [step == OVERFLOWING_STEP for step in range(STEPS)]
    assert scales == SCALES
    expected = _one_process(make_optimizer, clip=recipe is _horovods_step)
    for mine, want in zip(parameters, expected):
        np.testing.assert_allclose(mine, want, rtol=0, atol=1e-6)
