"""ZeroRedundancyOptimizer (hvdlite/torch/zero/): each rank holds the optimizer state
of its share of the elements only, and training reaches DistributedOptimizer's
parameters (float64: within 1e-10, only the order of summation differs; the issue's
promise is 1e-6), with bitwise the same parameters on every rank. Parameters of 0, 1,
prime and 2^k+-1 elements, in two dtypes, in chunks smaller than a parameter; frozen
and unused parameters; state dicts consolidated, loaded into the plain optimizer and
at another world size (a process set of fewer ranks); the errors, on every rank."""
from __future__ import annotations

import copy
from typing import Any, Callable

import pytest

torch = pytest.importorskip("torch")

import hvdlite.torch as hvd  # noqa: E402
from tests.mpi.conftest import assert_identical_everywhere  # noqa: E402

pytestmark = pytest.mark.timeout(180)
TOLERANCE = 1e-10
ROWS = 12          # a step's whole batch: split evenly at 1, 2, 3 and 4 ranks


class _Model(torch.nn.Module):
    """float64 layers of 85, 17, 51 and 3 elements, one of 33, a float32 one of 31
    and an empty one (0): two spaces, pieces that straddle ranks and chunks."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(11)
        self.first = torch.nn.Linear(5, 17).double()
        self.second = torch.nn.Linear(17, 3).double()
        self.extra = torch.nn.Parameter(torch.randn(33, dtype=torch.float64))
        self.gain = torch.nn.Parameter(torch.ones(31, dtype=torch.float32))
        self.empty = torch.nn.Parameter(torch.zeros(0, dtype=torch.float64))

    def forward(self, x: "torch.Tensor") -> "torch.Tensor":
        hidden = torch.tanh(self.first(x)) * self.gain[:17 % 31].double().mean()
        return self.second(hidden) + self.extra.sum() * 1e-2 + self.empty.sum()


def _batch(step: int) -> tuple["torch.Tensor", "torch.Tensor"]:
    generator = torch.Generator().manual_seed(500 + step)
    return (torch.randn(ROWS, 5, generator=generator, dtype=torch.float64),
            torch.randn(ROWS, 3, generator=generator, dtype=torch.float64))


def _shard(step: int, rank: int, size: int) -> tuple["torch.Tensor", "torch.Tensor"]:
    x, y = _batch(step)
    per = ROWS // size
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


OPTIMIZERS: dict[str, tuple[type, dict[str, Any]]] = {
    "adam": (torch.optim.Adam, {"lr": 0.01}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
    "momentum": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
}


def _train(model: "torch.nn.Module", optimizer: Any, steps: range,
           rank: int, size: int, before: Callable[[int], None] = lambda step: None) -> None:
    for step in steps:
        before(step)
        optimizer.zero_grad()
        x, y = _shard(step, rank, size)
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()


def _reference(name: str, steps: int) -> "torch.nn.Module":
    """DistributedOptimizer over the same shards."""
    model = _Model()
    kind, options = OPTIMIZERS[name]
    optimizer = hvd.DistributedOptimizer(kind(model.parameters(), **options))
    _train(model, optimizer, range(steps), hvd.rank(), hvd.size())
    return model


def _close(model: "torch.nn.Module", reference: "torch.nn.Module") -> None:
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.allclose(p, q, rtol=0, atol=TOLERANCE), (name, (p - q).abs().max())


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_training_reaches_distributed_optimizers_parameters(name: str, small_chunks: None) -> None:
    model = _Model()
    kind, options = OPTIMIZERS[name]
    optimizer = hvd.ZeroRedundancyOptimizer(model.parameters(), kind, **options)
    _train(model, optimizer, range(20), hvd.rank(), hvd.size())
    _close(model, _reference(name, 20))
    assert_identical_everywhere([p.detach().numpy() for p in model.parameters()])


def test_each_element_has_one_owner_and_shares_differ_by_one_at_most(small_chunks: None) -> None:
    model = _Model()
    optimizer = hvd.ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=0.01)
    _train(model, optimizer, range(2), hvd.rank(), hvd.size())
    sizes = hvd.allgather_object([(s.index, s.shard_size, s.total) for s in optimizer._spaces])
    for spaces in zip(*sizes):
        shares = [share for _, share, _ in spaces]
        assert sum(shares) == spaces[0][2] and max(shares) - min(shares) <= 1
    mine = sum(v.numel() for state in optimizer.local_optimizer.state.values()
               for v in state.values() if v.dim() > 0)
    every = sum(p.numel() for p in model.parameters()) * 2      # Adam's two moments
    assert mine <= every / hvd.size() + 2 * 2 * len(optimizer._spaces)


@pytest.mark.parametrize("set_to_none", [True, False], ids=["to-none", "in-place"])
def test_a_frozen_layer_stays_put_and_an_unused_one_is_averaged_as_zeros(
        small_chunks: None, set_to_none: bool) -> None:
    """Frozen on every rank: no rank has its gradient, and AdamW leaves it alone (a zero
    gradient would decay it), whether zero_grad() drops the gradients or zeroes them in
    place (the frozen layer must not get one then). Used by rank 0 only: its gradient is
    averaged with the others' zeros, as DistributedOptimizer averages it."""
    def run(make: Callable[[Any], Any]) -> "torch.nn.Module":
        model = _Model()
        model.first.weight.requires_grad_(False)
        optimizer = make(model)
        for step in range(5):
            optimizer.zero_grad(set_to_none=set_to_none)
            x, y = _shard(step, hvd.rank(), hvd.size())
            loss = torch.nn.functional.mse_loss(model(x), y)
            if hvd.rank() == 0:
                loss = loss + (model.extra ** 2).sum()
            loss.backward()
            optimizer.step()
        assert model.first.weight.grad is None
        return model

    zero = run(lambda m: hvd.ZeroRedundancyOptimizer(m.parameters(), torch.optim.AdamW,
                                                     lr=0.01, weight_decay=0.1))
    plain = run(lambda m: hvd.DistributedOptimizer(torch.optim.AdamW(m.parameters(), lr=0.01,
                                                                     weight_decay=0.1)))
    assert torch.equal(zero.first.weight, _Model().first.weight)
    _close(zero, plain)


def test_a_state_dict_loads_into_the_plain_optimizer_and_goes_on_alike(
        small_chunks: None) -> None:
    model = _Model()
    optimizer = hvd.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=0.01)
    _train(model, optimizer, range(4), hvd.rank(), hvd.size())
    optimizer.consolidate_state_dict(to=0)
    state = optimizer.state_dict() if hvd.rank() == 0 else None
    if hvd.rank() != 0:
        with pytest.raises(hvd.UsageError, match="consolidate_state_dict"):
            optimizer.state_dict()
    state = hvd.broadcast_object(state, root_rank=0)
    twin = copy.deepcopy(model)
    plain = torch.optim.AdamW(twin.parameters(), lr=0.01)
    plain.load_state_dict(state)          # the plain optimizer's own format
    _train(model, optimizer, range(4, 8), hvd.rank(), hvd.size())
    _train(twin, hvd.DistributedOptimizer(plain), range(4, 8), hvd.rank(), hvd.size())
    _close(model, twin)


def test_a_state_dict_loads_at_another_world_size(small_chunks: None) -> None:
    """Saved from every rank, loaded on a process set of one rank fewer: both go on
    to the same parameters (each step's whole batch split among the set's ranks)."""
    if hvd.size() < 2:
        pytest.skip("needs a smaller set")
    fewer = hvd.add_process_set(list(range(hvd.size() - 1)))
    try:
        model = _Model()
        optimizer = hvd.ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=0.01)
        _train(model, optimizer, range(3), hvd.rank(), hvd.size())
        optimizer.consolidate_state_dict(to=0)
        state = hvd.broadcast_object(optimizer.state_dict() if hvd.rank() == 0 else None, 0)
        resumed = copy.deepcopy(model)
        _train(model, optimizer, range(3, 6), hvd.rank(), hvd.size())
        if fewer.included():
            other = hvd.ZeroRedundancyOptimizer(resumed.parameters(), torch.optim.Adam,
                                                process_set=fewer, lr=0.01)
            other.load_state_dict(state)
            _train(resumed, other, range(3, 6), fewer.rank(), fewer.size())
            _close(resumed, model)
    finally:
        hvd.remove_process_set(fewer)


def test_add_param_group_keeps_every_ranks_state(small_chunks: None) -> None:
    def run(make: Callable[[list], Any]) -> "torch.nn.Module":
        model = _Model()
        optimizer = make(list(model.first.parameters()) + list(model.second.parameters()))
        _train(model, optimizer, range(3), hvd.rank(), hvd.size())
        optimizer.add_param_group({"params": [model.extra, model.gain, model.empty],
                                   "lr": 0.002})
        _train(model, optimizer, range(3, 6), hvd.rank(), hvd.size())
        return model

    zero = run(lambda ps: hvd.ZeroRedundancyOptimizer(ps, torch.optim.Adam, lr=0.01))
    plain = run(lambda ps: hvd.DistributedOptimizer(torch.optim.Adam(ps, lr=0.01)))
    _close(zero, plain)


def test_a_state_dict_of_another_model_fails_every_rank() -> None:
    model = _Model()
    optimizer = hvd.ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=0.01)
    other = torch.nn.Linear(3, 2).double()
    saved = torch.optim.Adam(other.parameters()).state_dict()
    with pytest.raises(hvd.MismatchError, match=r"groups hold \[2\] parameters"):
        optimizer.load_state_dict(saved)


def test_a_layout_that_differs_between_ranks_fails_every_rank() -> None:
    if hvd.size() < 2:
        pytest.skip("one rank agrees with itself")
    params = list(_Model().parameters())
    if hvd.rank() == hvd.size() - 1:
        params = params[:-2]
    with pytest.raises(hvd.MismatchError, match="variables differ"):
        hvd.ZeroRedundancyOptimizer(params, torch.optim.SGD, lr=0.1)


def test_a_sparse_gradient_on_one_rank_fails_every_rank() -> None:
    embedding = torch.nn.Embedding(10, 3, sparse=hvd.rank() == 0).double()
    optimizer = hvd.ZeroRedundancyOptimizer(embedding.parameters(), torch.optim.SGD, lr=0.1)
    embedding(torch.tensor([1, 2])).sum().backward()
    where = "this rank" if hvd.rank() == 0 else "another rank"
    with pytest.raises(hvd.UsageError, match=f"sparse gradient on {where}"):
        optimizer.step()


def test_a_set_without_this_rank_is_refused_here() -> None:
    if hvd.size() < 2:
        pytest.skip("needs a set without some rank")
    others = hvd.add_process_set(list(range(1, hvd.size())))
    try:
        if hvd.rank() == 0:
            with pytest.raises(hvd.UsageError, match="does not hold this rank"):
                hvd.ZeroRedundancyOptimizer(_Model().parameters(), torch.optim.SGD,
                                            process_set=others, lr=0.1)
    finally:
        hvd.remove_process_set(others)


@pytest.mark.parametrize("total", [0, 1, 2, 7, 31, 33, 127])
def test_reducescatter_with_explicit_splits_matches_numpy(total: int) -> None:
    """The splits a chunk gives its ranks (zero for most of a small chunk), summed and
    averaged, against NumPy."""
    import numpy as np
    from hvdlite.api import collectives
    from hvdlite.torch.adapter import TORCH
    size, rank = hvd.size(), hvd.rank()
    splits = [0] * size
    for element in range(total):        # all on the last rank first, then round the rest
        splits[(size - 1 + element * element) % size] += 1
    parts = [np.random.default_rng(r).standard_normal(total) for r in range(size)]
    for op, want in ((hvd.Sum, sum(parts)), (hvd.Average, sum(parts) / size)):
        handle = collectives.reducescatter_async(
            TORCH, torch.from_numpy(parts[rank]), name=f"splits.{total}.{int(op)}", op=op,
            splits=splits)
        got = hvd.synchronize(handle)
        start = sum(splits[:rank])
        np.testing.assert_allclose(got.numpy(), want[start:start + splits[rank]], rtol=1e-12)


def test_reducescatter_splits_that_differ_fail_every_rank() -> None:
    if hvd.size() < 2:
        pytest.skip("one rank agrees with itself")
    from hvdlite.api import collectives
    from hvdlite.torch.adapter import TORCH
    splits = [1] * hvd.size()
    splits[0 if hvd.rank() else -1] += 1
    with pytest.raises(hvd.MismatchError, match="splits"):
        hvd.synchronize(collectives.reducescatter_async(
            TORCH, torch.zeros(hvd.size() + 1), name="splits.differ", splits=splits))


def test_accumulating_two_backward_passes_per_step_matches_distributed_optimizer(
        small_chunks: None) -> None:
    def run(make: Callable[[Any], Any]) -> "torch.nn.Module":
        model = _Model()
        optimizer = make(model)
        for step in range(4):
            optimizer.zero_grad()
            for micro in range(2):
                x, y = _shard(2 * step + micro, hvd.rank(), hvd.size())
                torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
        return model

    zero = run(lambda m: hvd.ZeroRedundancyOptimizer(m.parameters(), torch.optim.Adam, lr=0.01))
    plain = run(lambda m: hvd.DistributedOptimizer(torch.optim.Adam(m.parameters(), lr=0.01),
                                                   backward_passes_per_step=2))
    _close(zero, plain)


def test_torchs_keywords_are_taken_or_refused_clearly() -> None:
    """A torch script's call: optimizer_class by keyword, parameters_as_bucket_view taken;
    overlap_with_ddp and a torch process group refused, on every rank alike."""
    model = _Model()
    hvd.ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam,
                                parameters_as_bucket_view=True, lr=0.01)
    with pytest.raises(hvd.NotSupportedError, match="overlap_with_ddp"):
        hvd.ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam,
                                    overlap_with_ddp=True, lr=0.01)
    with pytest.raises(hvd.UsageError, match="not a torch process group"):
        hvd.ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam,
                                    process_group=object(), lr=0.01)
    with pytest.raises(hvd.UsageError, match="not a torch process group"):
        hvd.ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, object(), lr=0.01)
