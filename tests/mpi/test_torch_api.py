"""hvdlite.torch: broadcasts of parameters and optimizer state, autograd through
collectives, SyncBatchNorm, and misuse errors."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import hvdlite.torch as hvd  # noqa: E402
from tests.mpi.outcomes import under_torchrun  # noqa: E402

OPTIMIZERS = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.5),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1),
}


def _model(seed: int) -> "torch.nn.Module":
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))


def _describe_state(optimizer: "torch.optim.Optimizer") -> list:
    """Everything in a state_dict, with tensors as (dtype, values) and scalars with types."""
    def flat(value: object) -> object:
        if isinstance(value, torch.Tensor):
            return ("tensor", str(value.dtype), value.detach().flatten().tolist())
        if isinstance(value, dict):
            return sorted((str(k), flat(v)) for k, v in value.items())
        if isinstance(value, (list, tuple)):
            return [flat(v) for v in value]
        return (type(value).__name__, value)
    return flat(optimizer.state_dict())  # type: ignore[return-value]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_rank0_checkpoint_reaches_every_rank(name: str) -> None:
    model = _model(seed=hvd.rank())          # every rank starts different
    optimizer = OPTIMIZERS[name](model.parameters())
    if hvd.rank() == 0:                      # only rank 0 "loaded a checkpoint": real state
        for _ in range(3):
            optimizer.zero_grad()
            model(torch.randn(8, 4)).pow(2).mean().backward()
            optimizer.step()
        optimizer.param_groups[0]["lr"] = 0.0123
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    before = [p.detach().clone() for p in model.parameters()]
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())), \
        "creating optimizer state must not change parameters"
    states = hvd.allgather_object(_describe_state(optimizer))
    assert all(state == states[0] for state in states)
    assert optimizer.param_groups[0]["lr"] == 0.0123
    params = hvd.allgather_object([p.detach().tolist() for p in model.parameters()])
    assert all(p == params[0] for p in params)


def test_broadcast_optimizer_state_with_empty_state_changes_nothing() -> None:
    model = _model(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.9)
    before = [p.detach().clone() for p in model.parameters()]
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert len(optimizer.state) == 0


class _BrokenStateOptimizer(torch.optim.SGD):
    def state_dict(self):  # type: ignore[no-untyped-def]
        raise RuntimeError("this state cannot be saved")


def test_a_root_whose_state_dict_fails_fails_every_rank() -> None:
    """Only the root reads its state_dict(): its failure reaches every rank, which
    would otherwise wait for a state that never comes."""
    optimizer = _BrokenStateOptimizer(_model(seed=0).parameters(), lr=0.1)
    with pytest.raises(hvd.StateError, match=r"root rank 0's optimizer.state_dict\(\) failed: "
                                             "RuntimeError: this state cannot be saved"):
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum, name="after.broken.state").item() == hvd.size()


def test_a_sharded_optimizer_is_refused_on_every_rank() -> None:
    optimizer = hvd.ZeroRedundancyOptimizer(_model(seed=0).parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(hvd.UsageError, match="sharded: each rank holds its own share"):
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)


def test_autograd_through_allreduce_allgather_broadcast() -> None:
    size, rank = hvd.size(), hvd.rank()
    x = torch.ones(3, requires_grad=True)
    hvd.allreduce(x, op=hvd.Sum, name="ag.allreduce").sum().backward()
    assert torch.equal(x.grad, torch.full((3,), float(size)))

    rows = torch.full((rank + 1, 2), float(rank), requires_grad=True)
    gathered = hvd.allgather(rows, name="ag.allgather")
    weights = torch.arange(gathered.numel(), dtype=torch.float32).view_as(gathered)
    (gathered * weights * (rank + 1)).sum().backward()    # each rank weighs differently
    start = sum(r + 1 for r in range(rank))
    mean_scale = sum(r + 1 for r in range(size)) / size    # the gradient is rank-averaged
    assert torch.allclose(rows.grad, weights[start:start + rank + 1] * mean_scale)

    y = torch.full((2,), float(rank), requires_grad=True)
    out = hvd.broadcast(y, root_rank=0, name="ag.broadcast")
    assert torch.equal(out.detach(), torch.zeros(2))
    (out * (rank + 1)).sum().backward()
    expected = sum(r + 1 for r in range(size)) / size if rank == 0 else 0.0
    assert torch.allclose(y.grad, torch.full((2,), expected))


def test_tensor_collectives_and_dtypes() -> None:
    size, rank = hvd.size(), hvd.rank()
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.int64, torch.uint8):
        t = torch.full((4,), rank + 1, dtype=dtype)
        out = hvd.allreduce(t, op=hvd.Sum, name=f"t.{dtype}")
        assert out.dtype == dtype and torch.equal(out, torch.full((4,), sum(range(1, size + 1)),
                                                                   dtype=dtype))
    inplace = torch.full((2, 3), float(rank))[:, ::2]      # non-contiguous view
    hvd.allreduce_(inplace, op=hvd.Max, name="t.inplace")
    assert torch.equal(inplace, torch.full((2, 2), float(size - 1)))
    received, splits = hvd.alltoall(torch.arange(size, dtype=torch.float32) + 10 * rank,
                                    splits=[1] * size, name="t.a2a")
    assert torch.equal(splits, torch.ones(size, dtype=torch.int32))
    assert torch.equal(received, torch.tensor([10.0 * r + rank for r in range(size)]))
    scattered = hvd.reducescatter(torch.ones(size * 2, 3), op=hvd.Sum, name="t.rs")
    assert torch.equal(scattered, torch.full((2, 3), float(size)))
    handle = hvd.allreduce_async(torch.ones(2), op=hvd.Sum, name="t.async")
    assert torch.equal(hvd.synchronize(handle), torch.full((2,), float(size)))


def test_sync_batch_norm_equals_batch_norm_over_whole_batch() -> None:
    size, rank = hvd.size(), hvd.rank()
    generator = torch.Generator().manual_seed(7)
    per_rank = 3
    x_all = torch.randn(per_rank * size, 4, 5, 5, generator=generator, dtype=torch.float64)
    dy_all = torch.randn(per_rank * size, 4, 5, 5, generator=generator, dtype=torch.float64)
    reference = torch.nn.BatchNorm2d(4).double()
    with torch.no_grad():
        reference.weight.uniform_(0.5, 1.5, generator=generator)
        reference.bias.uniform_(-0.5, 0.5, generator=generator)
    sync = hvd.SyncBatchNorm.convert_sync_batchnorm(torch.nn.Sequential(
        torch.nn.BatchNorm2d(4).double()))[0]
    sync.load_state_dict(reference.state_dict())
    x_ref = x_all.clone().requires_grad_()
    expected = reference(x_ref)
    expected.backward(dy_all)
    shard = slice(rank * per_rank, (rank + 1) * per_rank)
    x_mine = x_all[shard].clone().requires_grad_()
    out = sync(x_mine)
    out.backward(dy_all[shard])
    assert sync.weight.dtype == torch.float64
    assert torch.allclose(out, expected[shard].detach(), atol=1e-10)
    assert torch.allclose(x_mine.grad, x_ref.grad[shard], atol=1e-10)
    for local, full in ((sync.weight.grad, reference.weight.grad), (sync.bias.grad, reference.bias.grad)):
        assert torch.allclose(hvd.allreduce(local, op=hvd.Sum), full, atol=1e-10)
    assert torch.allclose(sync.running_mean, reference.running_mean, atol=1e-12)
    assert torch.allclose(sync.running_var, reference.running_var, atol=1e-12)
    sync.eval()
    reference.eval()
    assert torch.allclose(sync(x_all[shard]), reference(x_all[shard]), atol=1e-12)


def test_optimizer_misuse_errors() -> None:
    model = _model(seed=0)
    named = list(model.named_parameters())
    with pytest.raises(ValueError, match="duplicate names"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=[("w", p) for _, p in named])
    with pytest.raises(ValueError, match="misses 1 of"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=named[:-1])
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=named)
    model(torch.ones(2, 4)).sum().backward()
    with pytest.raises(hvd.HvdliteError, match="zero_grad"):
        optimizer.zero_grad()
    with pytest.raises(hvd.HvdliteError, match="more than backward_passes_per_step"):
        model(torch.ones(2, 4)).sum().backward()
    optimizer.step()              # still completes on every rank
    optimizer.zero_grad()
    with pytest.raises(ValueError, match="already a DistributedOptimizer"):
        hvd.DistributedOptimizer(optimizer)
