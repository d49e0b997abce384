"""hvdlite.torch training equivalence: N ranks on 1/N of every batch reach the
parameters of one process on the whole batch, and hold bitwise-identical copies."""
from __future__ import annotations

import hashlib
from typing import Any, Callable

import pytest

torch = pytest.importorskip("torch")

import hvdlite.torch as hvd  # noqa: E402
from hvdlite.api import runtime  # noqa: E402
from hvdlite.api.control import reconfigure  # noqa: E402
from hvdlite.negotiation.requests import Kind  # noqa: E402

PER_RANK = 6           # samples per rank per micro-batch
TOLERANCE = 1e-10      # float64 models: only summation order differs


def _model() -> "torch.nn.Module":
    torch.manual_seed(1234)
    return torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 3)).double()


def _batch(step: int, micro: int = 0) -> tuple["torch.Tensor", "torch.Tensor"]:
    """The global batch of a step, identical on every rank."""
    generator = torch.Generator().manual_seed(10_000 + 100 * step + micro)
    total = PER_RANK * hvd.size()
    return (torch.randn(total, 5, generator=generator, dtype=torch.float64),
            torch.randn(total, 3, generator=generator, dtype=torch.float64))


def _shard(tensor: "torch.Tensor") -> "torch.Tensor":
    return tensor[hvd.rank() * PER_RANK:(hvd.rank() + 1) * PER_RANK]


def _train(make_opt: Callable, distributed: bool, steps: int, passes: int = 1,
           compression: object = None) -> "torch.nn.Module":
    model = _model()
    optimizer = make_opt(model.parameters())
    if distributed:
        optimizer = hvd.DistributedOptimizer(
            optimizer, named_parameters=model.named_parameters(),
            backward_passes_per_step=passes, compression=compression or hvd.Compression.none)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for step in range(steps):
        optimizer.zero_grad()
        for micro in range(passes):
            x, y = _batch(step, micro)
            if distributed:
                x, y = _shard(x), _shard(y)
            torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return model


def _assert_identical_everywhere(model: "torch.nn.Module") -> None:
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
    digests = hvd.allgather_object(digest.hexdigest())
    assert len(set(digests)) == 1, f"parameters differ across ranks: {digests}"


OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=0.01),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_n_ranks_match_one_process_on_the_whole_batch(name: str) -> None:
    distributed = _train(OPTIMIZERS[name], True, steps=20)
    reference = _train(OPTIMIZERS[name], False, steps=20)
    for (pname, p), q in zip(distributed.named_parameters(), reference.parameters()):
        assert torch.allclose(p, q, rtol=0, atol=TOLERANCE), (pname, (p - q).abs().max())
    assert any(not torch.equal(p, q) for p, q in zip(distributed.parameters(), _model().parameters()))
    _assert_identical_everywhere(distributed)


def test_backward_passes_per_step_equals_local_accumulation() -> None:
    make = OPTIMIZERS["sgd"]
    distributed = _train(make, True, steps=5, passes=3)
    reference = _train(make, False, steps=5, passes=3)
    for p, q in zip(distributed.parameters(), reference.parameters()):
        assert torch.allclose(p, q, rtol=0, atol=TOLERANCE)
    _assert_identical_everywhere(distributed)


@pytest.mark.parametrize("compression", ["fp16", "bf16"])
def test_compression_within_tolerance(compression: str) -> None:
    make = OPTIMIZERS["sgd"]
    distributed = _train(make, True, steps=10, compression=getattr(hvd.Compression, compression))
    reference = _train(make, False, steps=10)
    tolerance = {"fp16": 2e-3, "bf16": 2e-2}[compression]   # relative to the largest weight
    for p, q in zip(distributed.parameters(), reference.parameters()):
        assert (p - q).abs().max() <= tolerance * q.abs().max(), (p - q).abs().max()
    _assert_identical_everywhere(distributed)


def test_parameters_without_gradient_on_some_ranks_still_complete() -> None:
    model = _model()
    extra = torch.nn.Linear(3, 3).double()
    params = list(model.parameters()) + list(extra.parameters())
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.1))
    x, y = _batch(0)
    out = model(_shard(x))
    if hvd.rank() == 0:          # only rank 0 uses `extra`
        out = extra(out)
    torch.nn.functional.mse_loss(out, _shard(y)).backward()
    optimizer.step()
    _assert_identical_everywhere(extra)


def test_lr_scheduler_and_state_dict_work_through_the_wrapper() -> None:
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    optimizer = hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters())
    assert isinstance(optimizer, torch.optim.Optimizer)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    x, y = _batch(0)
    torch.nn.functional.mse_loss(model(_shard(x)), _shard(y)).backward()
    optimizer.step()
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == inner.param_groups[0]["lr"] == 0.25
    assert optimizer.state_dict()["state"].keys() == inner.state_dict()["state"].keys()
    assert optimizer.state is inner.state


def test_synchronize_then_clip_then_step() -> None:
    model = _model()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())
    x, y = _batch(0)
    torch.nn.functional.mse_loss(model(_shard(x)), _shard(y)).backward()
    optimizer.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
    with optimizer.skip_synchronize():
        optimizer.step()
    _assert_identical_everywhere(model)


def _reduced_gradients(**options: object) -> tuple[list, list]:
    """Gradients after synchronize(), and how the optimizer's reductions scale: the
    (op, prescale, postscale) of every allreduce it started, and ("lane", scale) of
    every bucket it handed to a lane."""
    model = _model()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters(), **options)
    started = []
    engine = runtime.engine()
    submit, submit_lane = engine.submit, engine.submit_lane

    def spy(request: Any, finish: Any = None) -> int:
        desc = request.desc
        if desc.kind is Kind.ALLREDUCE:
            started.append((desc.op, desc.prescale, desc.postscale))
        return submit(request, finish)

    def spy_lane(lane_id: int, op: Any) -> int:
        started.append(("lane", op.scale))
        return submit_lane(lane_id, op)
    engine.submit, engine.submit_lane = spy, spy_lane   # instance attributes shadow
    try:
        x, y = _batch(0)
        torch.nn.functional.mse_loss(model(_shard(x)), _shard(y)).backward()
        optimizer.synchronize()
    finally:
        del engine.submit, engine.submit_lane
    return [p.grad.clone() for p in model.parameters()], started


@pytest.mark.parametrize("lane", [True, False])
def test_gradient_predivide_factor_gives_the_average(lane: bool) -> None:
    """Horovod's predivide: Sum with 1/f before and f/size after is the Average (on a
    lane, the two factors make one scale after the sum)."""
    if hvd.size() < 2:
        pytest.skip("on one rank nothing is reduced")
    previous = runtime.config().lane
    reconfigure(lane=lane)
    try:
        plain, plain_ops = _reduced_gradients()
        divided, divided_ops = _reduced_gradients(gradient_predivide_factor=4.0)
    finally:
        reconfigure(lane=previous)
    model = _model()                    # one process on the whole batch
    x, y = _batch(0)
    torch.nn.functional.mse_loss(model(x), y).backward()
    for p, q, whole in zip(plain, divided, model.parameters()):
        assert torch.allclose(p, q, rtol=1e-12, atol=0), (p - q).abs().max()
        assert torch.allclose(q, whole.grad, rtol=0, atol=TOLERANCE)
    if lane:
        assert set(plain_ops) == set(divided_ops) == {("lane", 1.0 / hvd.size())}
    else:
        assert set(plain_ops) == {(hvd.Average, 1.0, 1.0)}
        assert set(divided_ops) == {(hvd.Sum, 0.25, 4.0 / hvd.size())}   # the factor was used


def test_reductions_start_during_the_kth_backward_pass() -> None:
    """With backward_passes_per_step=k the hooks start every allreduce during the
    k-th backward, so communication overlaps it; step() only waits."""
    if hvd.size() < 2:
        pytest.skip("on one rank nothing is reduced")
    passes = 3
    model = _model()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters(),
                                         backward_passes_per_step=passes)
    in_flight = []
    for micro in range(passes):
        x, y = _batch(0, micro)
        torch.nn.functional.mse_loss(model(_shard(x)), _shard(y)).backward()
        in_flight.append(optimizer._reducer.pending)     # gradients being reduced
    optimizer.step()                    # every rank completes before anything is asserted
    assert in_flight == [0] * (passes - 1) + [len(list(model.parameters()))]
