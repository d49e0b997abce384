"""Local SGD (hvdlite/torch/local_sgd.py): N ranks stepping on their own shards and
averaging the models every ``period`` steps reach the parameters of N replicas simulated
in one process (float64, within 1e-10: only the order of summation differs); with
``period=1`` and plain SGD that is synchronous SGD on the whole batch. After an averaging
step every rank holds bitwise the same parameters."""
from __future__ import annotations

from typing import Any, Callable

import pytest

torch = pytest.importorskip("torch")

import hvdlite.torch as hvd  # noqa: E402
from hvdlite.torch.local_sgd import PeriodicModelAverager, PostLocalSGDOptimizer  # noqa: E402
from tests.mpi.conftest import digests  # noqa: E402

PER_RANK = 4
TOLERANCE = 1e-10


def _model() -> "torch.nn.Module":
    torch.manual_seed(4321)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 2)).double()


def _batch(step: int, rank: int) -> tuple["torch.Tensor", "torch.Tensor"]:
    """Rank ``rank``'s shard of a step's global batch."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return (torch.randn(PER_RANK, 5, generator=generator, dtype=torch.float64),
            torch.randn(PER_RANK, 2, generator=generator, dtype=torch.float64))


def _loss(model: "torch.nn.Module", step: int, rank: int) -> "torch.Tensor":
    x, y = _batch(step, rank)
    return torch.nn.functional.mse_loss(model(x), y)


OPTIMIZERS: dict[str, Callable[[Any], Any]] = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1),
    "momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=0.01),
}


def _simulated(name: str, period: int, warmup: int, steps: int) -> list["torch.Tensor"]:
    """hvd.size() replicas in this process: gradients averaged during the warm-up,
    each replica's own after it, the parameters averaged on the averager's steps."""
    size = hvd.size()
    replicas = [_model() for _ in range(size)]
    optimizers = [OPTIMIZERS[name](m.parameters()) for m in replicas]
    for step in range(steps):
        for rank, (model, optimizer) in enumerate(zip(replicas, optimizers)):
            optimizer.zero_grad()
            _loss(model, step, rank).backward()
        if step < warmup:
            for params in zip(*(m.parameters() for m in replicas)):
                mean = sum(p.grad for p in params) / size
                for p in params:
                    p.grad = mean.clone()
        for optimizer in optimizers:
            optimizer.step()
        if step >= warmup and (step - warmup) % period == 0:
            with torch.no_grad():
                for params in zip(*(m.parameters() for m in replicas)):
                    mean = sum(p for p in params) / size
                    for p in params:
                        p.copy_(mean)
    return [p.detach().clone() for p in replicas[hvd.rank()].parameters()]


def _trained(name: str, period: int, warmup: int, steps: int) -> "torch.nn.Module":
    model = _model()
    averager = PeriodicModelAverager(period, warmup_steps=warmup)
    optimizer = PostLocalSGDOptimizer(OPTIMIZERS[name](model.parameters()), averager)
    for step in range(steps):
        optimizer.zero_grad()
        _loss(model, step, hvd.rank()).backward()
        optimizer.step()
    assert averager.step == steps
    return model


def _digests(model: "torch.nn.Module") -> list[str]:
    return digests([p.detach().numpy() for p in model.parameters()])


def _close(model: "torch.nn.Module", expected: list["torch.Tensor"]) -> None:
    for got, want in zip(model.parameters(), expected):
        torch.testing.assert_close(got.detach(), want, rtol=0, atol=TOLERANCE)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("period,warmup,steps", [(1, 0, 5), (3, 2, 9), (4, 0, 9)])
def test_local_sgd_reaches_the_replicas_simulated_in_one_process(
        name: str, period: int, warmup: int, steps: int) -> None:
    model = _trained(name, period, warmup, steps)
    _close(model, _simulated(name, period, warmup, steps))
    assert len(set(_digests(model))) == 1      # the last step averaged: one model everywhere


def test_period_one_with_plain_sgd_is_synchronous_sgd_on_the_whole_batch() -> None:
    distributed = _trained("sgd", 1, 0, 6)
    whole = _model()
    optimizer = torch.optim.SGD(whole.parameters(), lr=0.1)
    for step in range(6):
        optimizer.zero_grad()
        loss = sum(_loss(whole, step, rank) for rank in range(hvd.size())) / hvd.size()
        loss.backward()
        optimizer.step()
    _close(distributed, [p.detach() for p in whole.parameters()])


def test_between_averages_each_rank_keeps_its_own_model() -> None:
    if hvd.size() == 1:
        pytest.skip("one rank has no one to differ from")
    model = _trained("sgd", 4, 0, 3)       # averaged at step 0 only, then two local steps
    assert len(set(_digests(model))) == hvd.size()


def test_a_parameter_no_rank_has_a_gradient_for_keeps_none_in_the_warm_up() -> None:
    model = _model()
    unused = torch.nn.Linear(3, 3).double()
    params = list(model.parameters()) + list(unused.parameters())
    optimizer = PostLocalSGDOptimizer(torch.optim.SGD(params, lr=0.1),
                                      PeriodicModelAverager(2, warmup_steps=3))
    before = [p.detach().clone() for p in unused.parameters()]
    for step in range(4):
        optimizer.zero_grad()
        _loss(model, step, hvd.rank()).backward()
        optimizer.step()
    assert all(p.grad is None for p in unused.parameters())
    assert all(torch.equal(p, b) for p, b in zip(unused.parameters(), before))


def test_a_gradient_only_some_ranks_have_is_averaged_with_zeros_in_the_warm_up() -> None:
    """Rank 0 alone uses a branch: every rank steps it by the mean of rank 0's gradient
    and the others' zeros, as synchronous SGD on the whole batch would."""
    model, branch = _model(), torch.nn.Linear(5, 2).double()
    optimizer = PostLocalSGDOptimizer(
        torch.optim.SGD(list(model.parameters()) + list(branch.parameters()), lr=0.1),
        PeriodicModelAverager(1, warmup_steps=1))
    reference = torch.nn.Linear(5, 2).double()
    reference.load_state_dict(branch.state_dict())
    x, y = _batch(0, 0)
    optimizer.zero_grad()
    loss = _loss(model, 0, hvd.rank())
    if hvd.rank() == 0:
        loss = loss + torch.nn.functional.mse_loss(branch(x), y)
    loss.backward()
    optimizer.step()
    torch.nn.functional.mse_loss(reference(x), y).backward()
    with torch.no_grad():
        for p in reference.parameters():
            p -= 0.1 * p.grad / hvd.size()
    _close(branch, [p.detach() for p in reference.parameters()])
    assert len(set(_digests(branch))) == 1


def test_the_averager_alone_averages_on_its_steps_only() -> None:
    model = _model()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(hvd.rank()))
    averager = PeriodicModelAverager(2, warmup_steps=1)
    mean = (hvd.size() - 1) / 2
    seen = []
    for _ in range(4):
        averager.average_parameters(model.named_parameters())
        seen.append(next(model.parameters()).flatten()[0].item())
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float(hvd.rank()))
    assert seen == [hvd.rank(), mean, hvd.rank(), mean]


def test_a_closure_runs_before_the_warm_ups_gradient_average() -> None:
    """step(closure): the closure's gradients are the ones averaged and stepped on, so
    training with a closure reaches the replicas as training without one."""
    model = _model()
    optimizer = PostLocalSGDOptimizer(OPTIMIZERS["sgd"](model.parameters()),
                                      PeriodicModelAverager(3, warmup_steps=2))
    for step in range(5):
        def closure(step: int = step) -> "torch.Tensor":
            optimizer.zero_grad()
            loss = _loss(model, step, hvd.rank())
            loss.backward()
            return loss
        assert isinstance(optimizer.step(closure), torch.Tensor)
    _close(model, _simulated("sgd", 3, 2, 5))


def test_state_dict_keeps_the_averagers_step() -> None:
    model = _model()
    optimizer = PostLocalSGDOptimizer(OPTIMIZERS["momentum"](model.parameters()),
                                      PeriodicModelAverager(3))
    for step in range(2):
        optimizer.zero_grad()
        _loss(model, step, hvd.rank()).backward()
        optimizer.step()
    saved = optimizer.state_dict()
    assert saved["step"] == 2
    restored = PostLocalSGDOptimizer(OPTIMIZERS["momentum"](model.parameters()),
                                     PeriodicModelAverager(3))
    restored.load_state_dict(saved)
    assert restored.averager.step == 2 and restored.state_dict()["state"].keys() == \
        saved["state"].keys()
    with pytest.raises(hvd.UsageError, match="not saved by a PostLocalSGDOptimizer"):
        restored.load_state_dict(restored.optim.state_dict())


@pytest.mark.parametrize("period,warmup", [(0, 0), (True, 0), (2.0, 0), (1, -1)])
def test_a_bad_period_or_warm_up_is_refused(period: Any, warmup: Any) -> None:
    with pytest.raises(hvd.UsageError, match="must be an int of at least"):
        PeriodicModelAverager(period, warmup_steps=warmup)


def test_what_is_not_an_optimizer_or_averager_is_refused() -> None:
    model = _model()
    with pytest.raises(hvd.UsageError, match="wraps a torch.optim.Optimizer"):
        PostLocalSGDOptimizer(model, PeriodicModelAverager(1))
    with pytest.raises(hvd.UsageError, match="takes a PeriodicModelAverager"):
        PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), object())
    with pytest.raises(hvd.UsageError, match="takes parameters"):
        PeriodicModelAverager(1).average_parameters([3])


def test_ranks_that_average_different_models_all_get_an_error() -> None:
    if hvd.size() == 1:
        pytest.skip("one rank agrees with itself")
    model = _model()
    params = list(model.parameters())
    mine = params if hvd.rank() == 0 else params[:-1]
    with pytest.raises(hvd.MismatchError, match=r"local_sgd\.parameters.*ranks \[0\]"):
        PeriodicModelAverager(1).average_parameters(mine)
