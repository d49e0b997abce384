"""hvdlite.torch with parameters that change whether they train, or get no gradient:
unfreezing a layer after the optimizer is made, freezing one mid-training, a mix of
both, a branch no rank uses on some steps, a branch some ranks use. In every case N
ranks on 1/N of each batch reach one process's parameters on the whole batch (float64,
within TOLERANCE: only summation order differs), every rank holds bitwise-identical
parameters, and a parameter no rank gave a gradient keeps ``.grad`` None, so Adam
leaves it where one process would. Ranks that freeze differently: a MismatchError on
every rank naming the parameter."""
from __future__ import annotations

from typing import Callable, Optional

import pytest

torch = pytest.importorskip("torch")

import hvdlite.torch as hvd  # noqa: E402
from tests.mpi.conftest import submissions  # noqa: E402
from tests.mpi.test_torch_training import (OPTIMIZERS, PER_RANK, TOLERANCE,  # noqa: E402
                                           _assert_identical_everywhere, _batch, _shard)

STEPS = 20


class _Branchy(torch.nn.Module):
    """A trunk, a head, and a branch whose output is added on the samples it is used on."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1234)
        self.trunk = torch.nn.Linear(5, 16)
        self.head = torch.nn.Linear(16, 3)
        self.branch = torch.nn.Linear(16, 3)
        self.double()

    def forward(self, x: "torch.Tensor", mask: Optional["torch.Tensor"]) -> "torch.Tensor":
        """``mask``: 1 for each sample the branch is used on; None: not used at all."""
        hidden = torch.tanh(self.trunk(x))
        out = self.head(hidden)
        return out if mask is None else out + mask[:, None] * self.branch(hidden)


Schedule = Callable[[int, _Branchy], None]        # (step, model): freezes, unfreezes
Uses = Callable[[int, int], bool]                  # (step, rank): the branch is used


def _never(step: int, rank: int) -> bool:
    return False


def _train(make_opt: Callable, distributed: bool, schedule: Schedule, uses: Uses = _never,
           set_to_none: bool = True) -> _Branchy:
    model = _Branchy()
    schedule(-1, model)                 # before the optimizer is made
    optimizer = make_opt(model.parameters())
    if distributed:
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    for step in range(STEPS):
        schedule(step, model)
        x, y = _batch(step)
        ranks = [rank for rank in range(hvd.size()) if uses(step, rank)]
        mask = torch.zeros(len(x), dtype=torch.float64)
        for rank in ranks:
            mask[rank * PER_RANK:(rank + 1) * PER_RANK] = 1
        if distributed:
            x, y = _shard(x), _shard(y)
            mask = torch.ones(PER_RANK, dtype=torch.float64) if hvd.rank() in ranks else None
        elif not ranks:
            mask = None
        optimizer.zero_grad(set_to_none=set_to_none)
        torch.nn.functional.mse_loss(model(x, mask), y).backward()
        optimizer.step()
    return model


def _assert_matches_one_process(make: str, schedule: Schedule, uses: Uses = _never,
                                set_to_none: bool = True) -> _Branchy:
    distributed = _train(OPTIMIZERS[make], True, schedule, uses, set_to_none)
    reference = _train(OPTIMIZERS[make], False, schedule, uses, set_to_none)
    for (name, p), q in zip(distributed.named_parameters(), reference.parameters()):
        assert torch.allclose(p, q, rtol=0, atol=TOLERANCE), (name, float((p - q).abs().max()))
    _assert_identical_everywhere(distributed)
    return distributed


def _unfreeze_trunk_at_10(step: int, model: _Branchy) -> None:
    if step in (-1, 10):
        model.trunk.requires_grad_(step == 10)


def _freeze_trunk_at_10(step: int, model: _Branchy) -> None:
    if step == 10:
        model.trunk.requires_grad_(False)


def _swap_at_7(step: int, model: _Branchy) -> None:
    """The trunk frozen first; at step 7 it trains and the head stops."""
    if step in (-1, 7):
        model.trunk.requires_grad_(step == 7)
        model.head.requires_grad_(step != 7)


def _nothing(step: int, model: _Branchy) -> None:
    pass


@pytest.mark.parametrize("make", sorted(OPTIMIZERS))
def test_a_layer_unfrozen_after_the_optimizer_is_made_is_averaged(make: str) -> None:
    model = _assert_matches_one_process(make, _unfreeze_trunk_at_10)
    assert not torch.equal(model.trunk.weight, _Branchy().trunk.weight)   # it did train


@pytest.mark.parametrize("make", sorted(OPTIMIZERS))
def test_a_layer_frozen_mid_training_stops_where_one_process_stops(make: str) -> None:
    model = _assert_matches_one_process(make, _freeze_trunk_at_10)
    assert all(p.grad is None for p in model.trunk.parameters())
    assert all(p.grad is not None for p in model.head.parameters())


@pytest.mark.parametrize("make", sorted(OPTIMIZERS))
def test_freezing_one_layer_and_unfreezing_another_at_once(make: str) -> None:
    _assert_matches_one_process(make, _swap_at_7)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_a_branch_no_rank_uses_on_some_steps_is_left_alone_by_adam(set_to_none: bool) -> None:
    """Used by every rank on even steps only: on odd steps no rank has its gradient,
    and Adam (momentum) must skip it as one process does (set_to_none=False: its
    gradient is zeros in both, and both move it)."""
    model = _assert_matches_one_process("adam", _nothing, lambda step, rank: step % 2 == 0,
                                        set_to_none)
    if set_to_none:              # the last step (19) did not use it
        assert all(p.grad is None for p in model.branch.parameters())


def test_a_branch_some_ranks_use_is_averaged_with_zeros_from_the_others() -> None:
    """Rank 0 uses it on every third step, the odd ranks on even steps."""
    model = _assert_matches_one_process(
        "adam", _nothing, lambda step, rank: (rank % 2 == 1 and step % 2 == 0)
        or (rank == 0 and step % 3 == 0))
    assert not torch.equal(model.branch.weight, _Branchy().branch.weight)


def test_a_parameter_no_rank_ever_uses_keeps_no_gradient() -> None:
    model = _Branchy()
    optimizer = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                         named_parameters=model.named_parameters())
    before = model.branch.weight.detach().clone()
    for step in range(3):
        x, y = _batch(step)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(_shard(x), None), _shard(y)).backward()
        optimizer.step()
    assert model.branch.weight.grad is None and torch.equal(model.branch.weight, before)
    assert model.branch not in optimizer.state and model.head.weight in optimizer.state


def _differently_frozen(rank: int, model: torch.nn.Module) -> None:
    """Two layers of one shape: rank 0 freezes the first, the others the second (the
    ranks' parameter lists have the same shapes: only requires_grad tells them apart)."""
    model[0 if rank == 0 else 1].requires_grad_(False)


@pytest.mark.parametrize("when", ["before", "after"])
def test_ranks_that_freeze_differently_get_a_mismatch_error_naming_it(when: str) -> None:
    if hvd.size() < 2:
        pytest.skip("needs two ranks to differ")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)).double()
    if when == "before":
        _differently_frozen(hvd.rank(), model)
    optimizer = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                         named_parameters=model.named_parameters())
    x = torch.randn(3, 4, dtype=torch.float64)
    if when == "after":           # a step with the same layout first
        model(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        _differently_frozen(hvd.rank(), model)
    model(x).sum().backward()
    with pytest.raises(hvd.MismatchError) as raised:
        optimizer.step()
    message = str(raised.value)
    assert f"rank {hvd.rank()}" in message and "'0.weight'" in message, message
    assert "frozen" in message and "trainable" in message and "requires_grad" in message
    # Mended on every rank, the next step agrees a layout and trains.
    model.requires_grad_(True)
    optimizer.zero_grad()
    model(x).sum().backward()
    optimizer.step()
    _assert_identical_everywhere(model)


def test_a_layer_unfrozen_inside_a_step_is_refused_by_step_then_laid_out() -> None:
    """Unfrozen between the two backward passes of one step (its gradient arrives after
    the step's layout was settled): step() names it on every rank, and the next step
    averages it."""
    model = _Branchy()
    model.trunk.requires_grad_(False)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters(),
                                         backward_passes_per_step=2)
    for micro in range(2):
        if micro == 1:
            model.trunk.requires_grad_(True)
        x, y = _batch(0, micro)
        torch.nn.functional.mse_loss(model(_shard(x), None), _shard(y)).backward()
    with pytest.raises(hvd.HvdliteError, match=rf"rank {hvd.rank()}: \['trunk.weight', "
                                               r"'trunk.bias'\] began to require a gradient"):
        optimizer.step()
    for step in range(2):
        optimizer.zero_grad()
        for micro in range(2):
            x, y = _batch(step, micro)
            torch.nn.functional.mse_loss(model(_shard(x), None), _shard(y)).backward()
        optimizer.step()
    assert not torch.equal(model.trunk.weight, _Branchy().trunk.weight)
    _assert_identical_everywhere(model)


def test_which_gradients_exist_costs_no_request_of_its_own() -> None:
    """A step with a branch no rank used, and one after unfreezing: one request per
    bucket (the flags ride in the buckets), plus the one layout exchange after the
    change."""
    if hvd.size() < 2:
        pytest.skip("on one rank nothing is reduced")
    model = _Branchy()
    model.trunk.requires_grad_(False)
    optimizer = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                         named_parameters=model.named_parameters())
    per_step = []
    for step in range(3):
        if step == 2:
            model.trunk.requires_grad_(True)
        with submissions() as names:
            x, y = _batch(step)
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(_shard(x), None), _shard(y)).backward()
            optimizer.step()
        per_step.append(names)
    buckets = [b.name for b in optimizer._reducer.buckets]
    assert all(".bucket." in name for name in per_step[1]) and len(per_step[1]) == 1
    assert sorted(n for n in per_step[2] if ".bucket." in n) == sorted(buckets)
    others = {n for n in per_step[2] if ".bucket." not in n}
    assert others and all(n.startswith("DistributedOptimizer.layout") for n in others)
