"""hvdlite.torch as a drop-in for horovod.torch: autograd through every
collective (checked against gradients computed on each rank from every rank's
deterministic inputs), the optimizer's synchronize()/step() warning, and the
object collectives on process sets. Size-agnostic."""
from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import hvdlite.torch as hvd  # noqa: E402
from tests.mpi.conftest import rank_data  # noqa: E402


def _data(rank: int, shape: tuple[int, ...], salt: int) -> "torch.Tensor":
    return torch.from_numpy(rank_data(rank, shape, np.float64, salt))


def _splits(rank: int, size: int) -> list[int]:
    """Uneven rows per destination, zeros included, different on every rank."""
    return [(rank + dest) % 3 for dest in range(size)]


def test_alltoall_gradient_returns_rows_to_their_sender() -> None:
    size, rank = hvd.size(), hvd.rank()
    splits = [_splits(r, size) for r in range(size)]
    inputs = [_data(r, (sum(splits[r]), 3), salt=1) for r in range(size)]
    x = inputs[rank].clone().requires_grad_()
    received, received_splits = hvd.alltoall(x, splits=splits[rank], name="parity.a2a")
    assert not received_splits.requires_grad
    assert received_splits.tolist() == [splits[src][rank] for src in range(size)]
    weights = [_data(r, (sum(splits[s][r] for s in range(size)), 3), salt=2)
               for r in range(size)]
    (received * weights[rank]).sum().backward()
    # Reference: row block x[rank][to dest] lands on dest after the blocks of lower
    # ranks, so its gradient is dest's weights at that offset.
    expected = []
    for dest in range(size):
        offset = sum(splits[src][dest] for src in range(rank))
        expected.append(weights[dest][offset:offset + splits[rank][dest]])
    # Forward: the rows from each source, in source order.
    sources = [inputs[src][sum(splits[src][:rank]):][:splits[src][rank]] for src in range(size)]
    assert torch.equal(received.detach(), torch.cat(sources))
    assert torch.equal(x.grad, torch.cat(expected))


def test_alltoall_even_split_returns_tensor_only_and_is_differentiable() -> None:
    size, rank = hvd.size(), hvd.rank()
    x = _data(rank, (2 * size, 2), salt=3).requires_grad_()
    out = hvd.alltoall(x, name="parity.a2a.even")
    assert isinstance(out, torch.Tensor) and out.shape == (2 * size, 2)
    out.mul(rank + 1).sum().backward()
    # Rows sent to rank d come back weighted by d + 1.
    expected = torch.cat([torch.full((2, 2), float(d + 1)) for d in range(size)])
    assert torch.equal(x.grad, expected.double())


def _blocks(rows: int, size: int) -> list[int]:
    return [rows // size + (1 if r < rows % size else 0) for r in range(size)]


@pytest.mark.parametrize("op", ["Sum", "Average"])
def test_reducescatter_gradient_is_allgather_of_gradient(op: str) -> None:
    size, rank = hvd.size(), hvd.rank()
    rows = 2 * size + 1                       # uneven blocks
    inputs = [_data(r, (rows, 2), salt=4) for r in range(size)]
    blocks = _blocks(rows, size)
    weights = [_data(r, (blocks[r], 2), salt=5) for r in range(size)]
    x = inputs[rank].clone().requires_grad_()
    out = hvd.reducescatter(x, op=getattr(hvd, op), name=f"parity.rs.{op}")
    total = sum(inputs) / (size if op == "Average" else 1)
    start = sum(blocks[:rank])
    assert torch.allclose(out.detach(), total[start:start + blocks[rank]])
    (out * weights[rank]).sum().backward()
    expected = torch.cat(weights) * (size if op == "Sum" else 1)   # Horovod's convention
    assert torch.allclose(x.grad, expected)


def test_reducescatter_gradient_matches_local_autograd() -> None:
    """Same check by running the whole computation on one rank with torch."""
    size, rank = hvd.size(), hvd.rank()
    rows = 3 * size
    inputs = [_data(r, (rows, 2), salt=6).requires_grad_() for r in range(size)]
    local = [t.detach().clone().requires_grad_() for t in inputs]
    blocks = _blocks(rows, size)
    mean = torch.stack(local).mean(0)
    pieces = torch.split(mean, blocks)
    sum(((p * (r + 1)) ** 2).sum() for r, p in enumerate(pieces)).backward()
    x = inputs[rank]
    out = hvd.reducescatter(x, name="parity.rs.local")
    ((out * (rank + 1)) ** 2).sum().backward()
    # Horovod's reducescatter gradient is the set size times the gradient of the sum of
    # every rank's loss (its HorovodReducescatter.backward), as for allreduce.
    assert torch.allclose(x.grad, local[rank].grad * size)


def test_grouped_allreduce_is_differentiable_per_tensor() -> None:
    size, rank = hvd.size(), hvd.rank()
    shapes = [(3,), (2, 2)]
    xs = [_data(rank, s, salt=7 + i).requires_grad_() for i, s in enumerate(shapes)]
    outs = hvd.grouped_allreduce(xs, op=hvd.Sum, name="parity.gar")
    for i, (out, shape) in enumerate(zip(outs, shapes)):
        assert torch.equal(out.detach(), sum(_data(r, shape, salt=7 + i) for r in range(size)))
    weights = [[_data(r, s, salt=20 + i) for i, s in enumerate(shapes)] for r in range(size)]
    sum((o * w).sum() for o, w in zip(outs, weights[rank])).backward()
    for i, x in enumerate(xs):
        assert torch.equal(x.grad, sum(weights[r][i] for r in range(size)))


def test_grouped_allgather_is_differentiable_per_tensor() -> None:
    size, rank = hvd.size(), hvd.rank()
    rows = [[r + 1, 2] for r in range(size)]          # tensor 0 uneven, tensor 1 even
    xs = [_data(rank, (rows[rank][i], 2), salt=30 + i).requires_grad_() for i in range(2)]
    outs = hvd.grouped_allgather(xs, name="parity.gag")
    totals = [sum(rows[r][i] for r in range(size)) for i in range(2)]
    weights = [[_data(r, (totals[i], 2), salt=40 + i) for i in range(2)] for r in range(size)]
    sum((o * w).sum() for o, w in zip(outs, weights[rank])).backward()
    for i, x in enumerate(xs):
        start = sum(rows[r][i] for r in range(rank))
        mean = sum(weights[r][i] for r in range(size)) / size
        assert torch.allclose(x.grad, mean[start:start + rows[rank][i]])


def test_grouped_reducescatter_is_differentiable_per_tensor() -> None:
    size, rank = hvd.size(), hvd.rank()
    row_counts = [size, 2 * size + 1]
    xs = [_data(rank, (n, 2), salt=50 + i).requires_grad_() for i, n in enumerate(row_counts)]
    outs = hvd.grouped_reducescatter(xs, name="parity.grs")    # Average
    blocks = [_blocks(n, size) for n in row_counts]
    weights = [[_data(r, (blocks[i][r], 2), salt=60 + i) for i in range(2)]
               for r in range(size)]
    sum((o * w).sum() for o, w in zip(outs, weights[rank])).backward()
    for i, x in enumerate(xs):
        expected = torch.cat([weights[r][i] for r in range(size)])    # Average: unscaled
        assert torch.allclose(x.grad, expected)


def test_step_after_synchronize_warns_once_and_reduces_once() -> None:
    size, rank = hvd.size(), hvd.rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1, bias=False)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                         named_parameters=model.named_parameters(), op=hvd.Sum)
    for step in range(2):
        optimizer.zero_grad()
        (model(torch.full((1, 3), float(rank + 1))).sum()).backward()
        optimizer.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            optimizer.step()
        messages = [str(w.message) for w in caught]
        horovods = "optimizer.step() called without optimizer.skip_synchronize()"
        assert len([m for m in messages if horovods in m]) == (1 if step == 0 else 0)
        expected = float(sum(r + 1 for r in range(size)))   # summed once, not twice
        assert torch.equal(model.weight.grad, torch.full((1, 3), expected))
    optimizer.zero_grad()
    model(torch.ones(1, 3)).sum().backward()
    optimizer.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with optimizer.skip_synchronize():
            optimizer.step()
    assert not caught


def test_object_collectives_take_process_set() -> None:
    size, rank = hvd.size(), hvd.rank()
    if size == 1:
        pytest.skip("needs a process set smaller than the world")
    members = list(range(0, size, 2))          # the even ranks: a proper subset
    subset = hvd.add_process_set(members)
    try:
        if rank in members:
            gathered = hvd.allgather_object({"rank": rank}, process_set=subset)
            assert gathered == [{"rank": r} for r in members]
            root = members[-1]                  # a global rank, as in Horovod
            value = hvd.broadcast_object(("from", rank), root_rank=root, process_set=subset)
            assert value == ("from", root)
    finally:
        hvd.remove_process_set(subset)


def _lookups(rank: int) -> "torch.Tensor":
    """Embedding rows each rank reads: overlapping across ranks, with repeats."""
    return torch.tensor([rank % 5, (rank + 2) % 5, rank % 5, 7], dtype=torch.int64)


@pytest.mark.parametrize("op", ["Sum", "Average"])
def test_sparse_allreduce_async_gathers_indices_and_values(op: str) -> None:
    size, rank = hvd.size(), hvd.rank()
    dense = [torch.zeros(8, 3, dtype=torch.float64) for _ in range(size)]
    for r in range(size):
        dense[r].index_add_(0, _lookups(r), _data(r, (4, 3), salt=70))
    handle = hvd.sparse_allreduce_async(dense[rank].to_sparse(1), name=f"parity.sparse.{op}",
                                        op=getattr(hvd, op))
    reduced = hvd.synchronize(handle)
    assert reduced.is_sparse and reduced.is_coalesced()
    expected = sum(dense) / (size if op == "Average" else 1)
    assert torch.allclose(reduced.to_dense(), expected)
    # Horovod's handles are also called to wait for the result.
    called = hvd.sparse_allreduce_async(dense[rank].to_sparse(1), op=getattr(hvd, op),
                                        name=f"parity.sparse.call.{op}")()
    assert torch.allclose(called.to_dense(), expected)


def test_optimizer_reduces_sparse_embedding_gradients_by_allgather() -> None:
    size, rank = hvd.size(), hvd.rank()

    def model() -> "torch.nn.Module":
        torch.manual_seed(3)
        return torch.nn.Embedding(8, 3, sparse=True).double()
    mine, reference = model(), model()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(mine.parameters(), lr=0.5),
                                         named_parameters=mine.named_parameters())
    for _ in range(2):
        optimizer.zero_grad()
        (mine(_lookups(rank)) * _data(rank, (4, 3), salt=71)).sum().backward()
        optimizer.step()
        # Reference: the rank-averaged gradient, computed here from every rank's batch.
        reference.zero_grad()
        loss = sum((reference(_lookups(r)) * _data(r, (4, 3), salt=71)).sum()
                   for r in range(size)) / size
        loss.backward()
        with torch.no_grad():
            reference.weight -= 0.5 * reference.weight.grad.to_dense()
        assert mine.weight.grad.is_sparse
        assert torch.allclose(mine.weight, reference.weight)


def _sparse_adams(seed: int, **options: Any) -> tuple:
    """Two copies of one sparse embedding: one trained here by a DistributedOptimizer
    around SparseAdam (with ``options``), the other by SparseAdam alone, as reference."""
    def model() -> "torch.nn.Module":
        torch.manual_seed(seed)
        return torch.nn.Embedding(8, 3, sparse=True).double()
    mine, reference = model(), model()
    optimizer = hvd.DistributedOptimizer(torch.optim.SparseAdam(list(mine.parameters()), lr=0.1),
                                         named_parameters=mine.named_parameters(), **options)
    return mine, reference, optimizer, torch.optim.SparseAdam(list(reference.parameters()),
                                                              lr=0.1)


@pytest.mark.parametrize("sparse_as_dense", [False, True])
def test_sparse_adam_takes_its_sparse_gradient_back(sparse_as_dense: bool) -> None:
    """SparseAdam refuses dense gradients: with sparse_as_dense the gradient is reduced
    dense and handed back sparse, as Horovod does. The result matches SparseAdam on
    the rank-averaged gradient, identically on every rank."""
    size, rank = hvd.size(), hvd.rank()
    mine, reference, optimizer, local = _sparse_adams(5, sparse_as_dense=sparse_as_dense)
    for _ in range(2):
        optimizer.zero_grad()
        (mine(_lookups(rank)) * _data(rank, (4, 3), salt=72)).sum().backward()
        optimizer.step()
        local.zero_grad()
        loss = sum((reference(_lookups(r)) * _data(r, (4, 3), salt=72)).sum()
                   for r in range(size)) / size
        loss.backward()
        local.step()
        assert mine.weight.grad.is_sparse
    gathered = hvd.allgather(mine.weight.detach()[None], name=f"sparse_adam.{sparse_as_dense}")
    assert all(torch.equal(gathered[0], g) for g in gathered)
    assert torch.allclose(mine.weight, reference.weight, atol=1e-12)


def test_a_sparse_gradient_no_rank_has_stays_none_for_sparse_adam() -> None:
    """An embedding unused on every rank for two steps (no backward reaches it): its
    .grad stays None, as in one process, so SparseAdam counts no step for it, and the
    steps after it match SparseAdam in one process on the rank-averaged gradient."""
    size, rank = hvd.size(), hvd.rank()
    mine, reference, optimizer, local = _sparse_adams(6)
    for step in range(6):
        used = step not in (2, 3)
        optimizer.zero_grad()
        if used:
            (mine(_lookups(rank)) * _data(rank, (4, 3), salt=73 + step)).sum().backward()
        optimizer.step()
        local.zero_grad()
        if used:
            loss = sum((reference(_lookups(r)) * _data(r, (4, 3), salt=73 + step)).sum()
                       for r in range(size)) / size
            loss.backward()
        local.step()
        assert (mine.weight.grad is None) == (not used)
    assert optimizer.state[mine.weight]["step"] == local.state[reference.weight]["step"]
    gathered = hvd.allgather(mine.weight.detach()[None], name="sparse_adam.unused")
    assert all(torch.equal(gathered[0], g) for g in gathered)
    assert torch.allclose(mine.weight, reference.weight, atol=1e-12)


def test_parameter_names_as_horovod_keeps_them() -> None:
    """optimizer._parameter_names maps each parameter to a unique name, the same on
    every rank, with or without named_parameters."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    groups = [{"params": model[0].parameters()}, {"params": model[1].parameters()}]
    unnamed = hvd.DistributedOptimizer(torch.optim.SGD(groups, lr=0.1))
    named = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters())
    for optimizer in (unnamed, named):
        names = optimizer._parameter_names
        assert set(names) == set(model.parameters()) and len(set(names.values())) == 4
        everyone = hvd.allgather_object(sorted(names.values()))
        assert all(n == everyone[0] for n in everyone)
    assert {named._parameter_names[p]: p for p in model.parameters()}["0.weight"] is model[0].weight
