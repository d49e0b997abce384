"""torch.amp.GradScaler with ZeroRedundancyOptimizer, as torch's AMP recipe calls it
(``scaler.step(optimizer)`` straight after ``backward()``): when one rank's batch
overflows, every rank skips that step and every rank's loss scale stays the same; the
parameters match one process that trains on every rank's batch and skips the same
step (within 1e-6), as DistributedOptimizer's do (tests/mpi/test_torch_grad_scaler.py,
whose model and batches these are). Unscaling before ``scaler.step`` is refused on
every rank. The ranks agree on an overflow on a lane of the optimizer's own, with no
negotiation round, where lanes are on."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import hvdlite.torch as hvd  # noqa: E402
from tests.mpi.conftest import assert_identical_everywhere, handed  # noqa: E402
from tests.mpi.test_torch_grad_scaler import (OVERFLOWING_STEP, SCALES, STEPS, _batch,  # noqa: E402
                                              _Model, _one_process)

pytestmark = pytest.mark.timeout(120)


OPTIMIZERS: dict[str, tuple[type, dict[str, Any]]] = {
    "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    "adam": (torch.optim.Adam, {"lr": 0.05}),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_one_ranks_overflow_skips_the_step_on_every_rank(name: str) -> None:
    kind, options = OPTIMIZERS[name]
    model = _Model()
    optimizer = hvd.ZeroRedundancyOptimizer(model.parameters(), kind, **options)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=2)
    scales, skipped = [], []
    for step in range(STEPS):
        before = [p.detach().clone() for p in model.trunk.parameters()]
        optimizer.zero_grad()
        scaler.scale(model(_batch(hvd.rank(), step), hvd.rank(), step)).backward()
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
        skipped.append(all(torch.equal(a, p) for a, p in zip(before, model.trunk.parameters())))
    parameters = [p.detach().numpy() for p in model.parameters()]
    assert_identical_everywhere(parameters + [np.array(scales)])
    assert skipped == [step == OVERFLOWING_STEP for step in range(STEPS)]
    assert scales == SCALES
    expected = _one_process(lambda m: kind(m.parameters(), **options), clip=False)
    for mine, want in zip(parameters, expected):
        np.testing.assert_allclose(mine, want, rtol=0, atol=1e-6)


def test_unscaling_before_the_step_is_refused_on_every_rank() -> None:
    model = _Model()
    kind, options = OPTIMIZERS["sgd"]
    optimizer = hvd.ZeroRedundancyOptimizer(model.parameters(), kind, **options)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    scaler.scale(model(_batch(hvd.rank(), 0), hvd.rank(), 0)).backward()
    scaler.unscale_(optimizer)
    with pytest.raises(hvd.NotSupportedError, match=r"scaler.unscale_\(optimizer\) before"):
        scaler.step(optimizer)


def test_the_ranks_agree_on_an_overflow_without_a_round_where_lanes_are_on(lane: bool) -> None:
    """Each scaled step's vote goes on the optimizer's overflow lane (opened, with one
    round, at the first): from the second step on, a step whose chunks go on lanes negotiates
    nothing; with HVDLITE_LANE=0 the vote is one negotiated allreduce."""
    model = _Model()
    kind, options = OPTIMIZERS["sgd"]
    optimizer = hvd.ZeroRedundancyOptimizer(model.parameters(), kind, **options)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=2)
    for step in range(STEPS):
        with handed() as (_, negotiated, on_lanes):
            optimizer.zero_grad()
            scaler.scale(model(_batch(hvd.rank(), step), hvd.rank(), step)).backward()
            scaler.step(optimizer)
            scaler.update()
        votes = [name for name in (on_lanes if lane else negotiated)
                 if name.endswith(".overflow")]
        assert len(votes) == 1, (negotiated, on_lanes)
        if lane and step:
            assert not any(name.endswith(".overflow") for name in negotiated), negotiated
        if step and optimizer._lanes:
            assert negotiated == [], negotiated
