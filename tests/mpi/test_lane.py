"""The lane (hvdlite/engine/lane.py): agreed buckets reduced with no negotiation round,
and what the round guaranteed kept by the check words each bucket carries. Each test
runs the same training with the lane and without (HVDLITE_LANE=0: every bucket
negotiated) where the two must agree."""
from __future__ import annotations

import re

import pytest

torch = pytest.importorskip("torch")

import hvdlite.torch as hvd  # noqa: E402
from hvdlite.api import runtime  # noqa: E402
from tests.mpi.conftest import assert_identical_everywhere, submissions  # noqa: E402

pytestmark = pytest.mark.timeout(120)
ROWS = 6
_RESULTS: dict[bool, list["torch.Tensor"]] = {}     # the join test's, by path


def _model() -> "torch.nn.Module":
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 3))


def _optimizer(model: "torch.nn.Module", **options: object) -> "hvd.DistributedOptimizer":
    return hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5),
                                    named_parameters=model.named_parameters(), **options)


def _loss(model: "torch.nn.Module", rank: int, step: int) -> "torch.Tensor":
    generator = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(ROWS, 5, generator=generator)
    return model(x).pow(2).mean()


def _params(model: "torch.nn.Module") -> list["torch.Tensor"]:
    return [p.detach().clone() for p in model.parameters()]


def test_steps_after_the_first_go_on_the_lane_only(lane: bool) -> None:
    """With the lane, a step hands each bucket to the lane and negotiates nothing."""
    if hvd.size() < 2:
        pytest.skip("on one rank nothing is reduced")
    model = _model()
    optimizer = _optimizer(model)
    per_step = []
    before = _lane_sums()
    for step in range(3):
        with submissions() as names:
            optimizer.zero_grad()
            _loss(model, hvd.rank(), step).backward()
            optimizer.step()
        per_step.append(names)
    buckets = [b.name for b in optimizer._reducer.buckets]
    assert per_step[1] == per_step[2] == buckets
    assert (optimizer._reducer._lane is not None) == lane
    assert _lane_sums() - before == (3 * len(buckets) if lane else 0)
    assert_identical_everywhere(_params(model))


def _lane_sums() -> int:
    return runtime.engine().lanes.traffic.snapshot().get("allreduce", {}).get("calls", 0)


def test_a_rank_that_skipped_a_step_fails_every_rank_naming_both(lane: bool) -> None:
    """The last rank reduces a step's gradients but does not step: from the next step
    on, the ranks' buckets belong to different optimizer steps. On the lane that is a
    MismatchError on every rank, naming each rank's step, and no rank's optimizer
    steps on the mixed gradients; negotiated, the buckets share their names from step
    to step, so the ranks go on, apart."""
    if hvd.size() < 2:
        pytest.skip("needs two ranks")
    model = _model()
    optimizer = _optimizer(model)
    last = hvd.size() - 1
    for step in range(2):
        optimizer.zero_grad()
        _loss(model, hvd.rank(), step).backward()
        if hvd.rank() == last and step == 1:
            optimizer.synchronize()             # reduced, never stepped
        else:
            optimizer.step()
    before = _params(model)
    optimizer.zero_grad()
    _loss(model, hvd.rank(), 2).backward()
    error = None
    try:
        optimizer.step()
    except hvd.HvdliteError as caught:
        error = caught
    if not lane:
        assert error is None, error
        return
    assert isinstance(error, hvd.MismatchError), repr(error)
    steps = ", ".join(f"rank {r}: step {1 if r == last else 2}" for r in range(hvd.size()))
    assert re.search(rf"rank {hvd.rank()}: .*different optimizer steps.*\({steps}\)",
                     str(error)), error
    for now, then in zip(_params(model), before):
        assert torch.equal(now, then)


def test_join_with_uneven_batches_trains_as_negotiated(lane: bool) -> None:
    """Rank r has r + 1 batches, then joins; the ranks still training average with
    zeros from the joined ones, over every rank (Horovod's join). The parameters
    match the negotiated path's (kept from the first run) on every rank; the lane
    takes the next steps as before."""
    model = _model()
    optimizer = _optimizer(model)
    for step in range(hvd.rank() + 1):
        optimizer.zero_grad()
        _loss(model, hvd.rank(), step).backward()
        optimizer.step()
    last = hvd.join()
    assert last == hvd.size() - 1
    params = _params(model)
    _RESULTS.setdefault(lane, params)
    other = _RESULTS.get(not lane)
    if other is not None:
        for mine, theirs in zip(params, other):
            torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-7)
    model = _model()                    # after join(), every rank trains on the lane
    optimizer = _optimizer(model)
    for step in range(2):
        optimizer.zero_grad()
        _loss(model, hvd.rank(), step).backward()
        optimizer.step()
    assert_identical_everywhere(_params(model))

