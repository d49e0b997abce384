"""DistributedOptimizer behaviours that mutation testing found unpinned: parameter
groups added later, a backward() between synchronize() and step(), which path a
sparse gradient takes, and zero_grad() while only sparse gradients are pending.
Every test compares against what one process computes from every rank's batch."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import hvdlite.torch as hvd  # noqa: E402
from tests.mpi.conftest import assert_identical_everywhere  # noqa: E402
from tests.mpi.outcomes import channel  # noqa: E402


def _batch(rank: int, salt: int) -> "torch.Tensor":
    return torch.linspace(-1.0, 1.0, 8, dtype=torch.float64).reshape(2, 4) * (rank + 1 + salt)


def _averaged_grads(model: "torch.nn.Module", salt: int) -> list:
    """Each parameter's gradient averaged over every rank's batch, computed here."""
    model.zero_grad()
    loss = sum(model(_batch(r, salt)).pow(2).sum() for r in range(hvd.size())) / hvd.size()
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def _linear(seed: int) -> "torch.nn.Module":
    torch.manual_seed(seed)
    return torch.nn.Linear(4, 3).double()


def test_parameter_groups_added_later_are_averaged_too() -> None:
    models = [_linear(1), _linear(2), _linear(15)]
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(models[0].parameters(), lr=0.1))
    for model in models[1:]:                  # the second group, then the third
        optimizer.add_param_group({"params": list(model.parameters())})
    optimizer.zero_grad()
    sum(m(_batch(hvd.rank(), salt)).pow(2).sum() for salt, m in enumerate(models)).backward()
    optimizer.step()
    expected = []
    for salt, seed in enumerate((1, 2, 15)):
        reference = _linear(seed)
        grads = _averaged_grads(reference, salt)
        expected += [p.detach() - 0.1 * g for p, g in zip(reference.parameters(), grads)]
    got = [p.detach() for m in models for p in m.parameters()]
    assert_identical_everywhere([p.numpy() for p in got])
    for mine, want in zip(got, expected):
        assert torch.allclose(mine, want, atol=1e-12), (mine, want)


def test_a_backward_between_synchronize_and_step_is_reduced_by_step() -> None:
    """synchronize(), then zero_grad() and a new backward(): step() must wait for
    the new gradients' reduction, not apply them as they are on this rank."""
    model, reference = _linear(3), _linear(3)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    model(_batch(hvd.rank(), 5)).pow(2).sum().backward()
    optimizer.synchronize()
    optimizer.zero_grad()
    model(_batch(hvd.rank(), 7)).pow(2).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")       # step() right after synchronize() warns
        optimizer.step()
    optimizer.zero_grad()                     # nothing is left in flight
    grads = _averaged_grads(reference, 7)
    expected = [p.detach() - 0.1 * g for p, g in zip(reference.parameters(), grads)]
    got = [p.detach() for p in model.parameters()]
    assert_identical_everywhere([p.numpy() for p in got])
    for mine, want in zip(got, expected):
        assert torch.allclose(mine, want, atol=1e-12)


def _embedding() -> "torch.nn.Module":
    torch.manual_seed(4)
    return torch.nn.Embedding(8, 3, sparse=True).double()


def _moved(kind: str) -> int:
    """Bytes this rank has sent through collectives of ``kind``, over every backend."""
    backends = hvd.traffic()["backends"].values()
    return sum(b["kinds"].get(kind, {}).get("sent", 0) for b in backends)


@pytest.mark.parametrize("sparse_as_dense", [False, True, None])   # None: the default
def test_sparse_gradients_travel_by_allgather_unless_made_dense(sparse_as_dense: bool) -> None:
    if hvd.size() == 1:
        pytest.skip("one rank sends nothing")
    model = _embedding()
    settings = {} if sparse_as_dense is None else {"sparse_as_dense": sparse_as_dense}
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         **settings)
    model(torch.tensor([hvd.rank() % 8, 1])).sum().backward()   # the hook submits it
    optimizer.step()                  # (the first step also agrees the buckets' layout)
    optimizer.zero_grad()
    before = {kind: _moved(kind) for kind in ("allgather", "allreduce")}
    model(torch.tensor([hvd.rank() % 8, 1])).sum().backward()
    optimizer.step()
    moved = {kind: _moved(kind) - before[kind] for kind in before}
    assert model.weight.grad.is_sparse
    if sparse_as_dense:
        assert moved["allreduce"] > 0 and moved["allgather"] == 0, moved
    else:
        assert moved["allgather"] > 0 and moved["allreduce"] == 0, moved


def test_zero_grad_refuses_while_only_sparse_gradients_are_pending() -> None:
    torch.manual_seed(4)
    tables = [torch.nn.Embedding(8, 3, sparse=True).double() for _ in range(2)]
    dense = _linear(5)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(
        [p for m in tables + [dense] for p in m.parameters()], lr=0.1))
    sum(t(torch.tensor([0, 1])).sum() for t in tables).backward()
    with pytest.raises(hvd.HvdliteError, match="while 2 gradients are still being averaged"):
        optimizer.zero_grad()
    dense(_batch(hvd.rank(), 0)).sum().backward()
    with pytest.raises(hvd.HvdliteError, match="while 4 gradients are still being averaged"):
        optimizer.zero_grad()                 # two tables', and the weight's and bias's
    optimizer.step()                          # still completes on every rank
    optimizer.zero_grad()
    assert all(np.isfinite(t.weight.detach().numpy()).all() for t in tables)


def test_a_frozen_parameter_in_an_added_group_is_left_alone() -> None:
    model, frozen = _linear(6), _linear(7)
    for param in frozen.parameters():
        param.requires_grad_(False)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    before = [p.detach().clone() for p in frozen.parameters()]
    optimizer.add_param_group({"params": list(frozen.parameters())})
    optimizer.add_param_group({"params": []})      # nothing new: nothing registered twice
    optimizer.zero_grad()
    model(_batch(hvd.rank(), 2)).pow(2).sum().backward()
    optimizer.step()
    assert all(torch.equal(p, b) for p, b in zip(frozen.parameters(), before))
    assert_identical_everywhere([p.detach().numpy() for p in model.parameters()])


def test_four_positional_arguments_mean_no_op_argument() -> None:
    """op is the fifth positional argument (Horovod's order): with four, the default."""
    model = _linear(8)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         list(model.named_parameters()), hvd.Compression.none, 1)
    assert type(optimizer) is hvd.DistributedOptimizer


@pytest.mark.parametrize("item", ["one", "three"])
def test_named_parameters_must_be_pairs(item: str) -> None:
    model = _linear(9)
    named = [(n, p) for n, p in model.named_parameters()]
    bad = (named[0][0],) if item == "one" else (named[0][0], named[0][1], "extra")
    with pytest.raises(ValueError, match=r"must be \(name, parameter\) pairs"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=[bad] + named[1:])


def test_missing_names_list_the_first_five_indices() -> None:
    torch.manual_seed(0)
    layers = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(4)])   # 8 parameters
    with pytest.raises(ValueError, match=r"misses 7 of .* 8 parameters \(indices \[1, 2, 3, 4, 5\]"):
        hvd.DistributedOptimizer(torch.optim.SGD(layers.parameters(), lr=0.1),
                                 named_parameters=list(layers.named_parameters())[:1])


def test_the_step_after_synchronize_warning_points_at_the_callers_line() -> None:
    model = _linear(10)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    model(_batch(hvd.rank(), 0)).sum().backward()
    optimizer.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer.step()
    assert [w.filename for w in caught] == [__file__], [(w.filename, str(w.message)) for w in caught]


@pytest.mark.timeout(60)
def test_ranks_without_a_backward_still_take_part_in_step() -> None:
    """Only rank 0 computes a loss this step; the others call step() alone and take
    part with zero gradients (else rank 0 would wait for them for ever)."""
    model, reference = _linear(11), _linear(11)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    optimizer.zero_grad()
    if hvd.rank() == 0:
        model(_batch(0, 3)).pow(2).sum().backward()
    optimizer.step()
    reference(_batch(0, 3)).pow(2).sum().backward()
    expected = [p.detach() - 0.1 * p.grad / hvd.size() for p in reference.parameters()]
    got = [p.detach() for p in model.parameters()]
    assert_identical_everywhere([p.numpy() for p in got])
    for mine, want in zip(got, expected):
        assert torch.allclose(mine, want, atol=1e-12)


def test_a_training_loop_warns_of_nothing_and_zero_grad_frees_the_gradients() -> None:
    model = _linear(12)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            optimizer.zero_grad()
            assert all(p.grad is None for p in model.parameters())   # torch's default
            model(_batch(hvd.rank(), step)).pow(2).sum().backward()
            optimizer.step()
        optimizer.zero_grad()
        model(_batch(hvd.rank(), 9)).pow(2).sum().backward()
        optimizer.synchronize()
        with optimizer.skip_synchronize():
            optimizer.step()                  # said to skip: no warning
    assert [str(w.message) for w in caught] == []


def test_the_wrapped_optimizers_attributes_show_through() -> None:
    model = _linear(13)
    inner = torch.optim.SGD(model.parameters(), lr=0.25, momentum=0.5)
    inner.custom_setting = "kept"
    optimizer = hvd.DistributedOptimizer(inner)
    assert optimizer.defaults["lr"] == 0.25 and optimizer.defaults is inner.defaults
    assert optimizer.custom_setting == "kept"
    with pytest.raises(AttributeError):
        optimizer.no_such_attribute


def test_two_parameters_with_one_name_are_refused() -> None:
    model = _linear(14)
    (_, weight), (_, bias) = model.named_parameters()
    with pytest.raises(ValueError, match=r"duplicate names: \['w'\]"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=[("w", weight), ("w", bias)])


def test_skip_synchronize_without_synchronize_steps_with_this_ranks_gradients() -> None:
    """As Horovod: inside skip_synchronize() step() does not wait for the reduction;
    the gradients still in flight are collected by the next synchronize(). The other
    ranks start their backward only once rank 0 has stepped (a barrier on the suite's own
    channel, not a sleep, which a loaded host outran), so rank 0's reduction cannot have
    finished by its step."""
    if hvd.size() == 1:
        pytest.skip("needs a peer whose gradient comes late")
    model = _linear(16)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    model(_batch(hvd.rank(), 3)).pow(2).sum().backward()
    optimizer.step()                          # the first step agrees the layout, together
    optimizer.zero_grad()
    if hvd.rank() != 0:
        channel().idle_until_all_arrive()     # rank 0 has stepped
    model(_batch(hvd.rank(), 4)).pow(2).sum().backward()
    local = [(p.detach() - 0.1 * p.grad).clone() for p in model.parameters()]
    with optimizer.skip_synchronize():
        optimizer.step()
    stepped_locally = all(torch.allclose(p.detach(), w) for p, w in zip(model.parameters(), local))
    if hvd.rank() == 0:
        channel().idle_until_all_arrive()     # the others may start their backward now
    optimizer.synchronize()                   # nothing is left in flight
    optimizer.zero_grad()
    everywhere = hvd.allgather_object(stepped_locally)
    assert everywhere[0], everywhere          # the late ranks' own steps may see either


def test_op_as_the_fifth_positional_argument() -> None:
    """Horovod's order: (optimizer, named_parameters, compression,
    backward_passes_per_step, op, ...); op=Adasum picks the delta-reducing class."""
    if hvd.size() & (hvd.size() - 1):
        pytest.skip("Adasum needs a power-of-two size")
    model = _linear(17)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         list(model.named_parameters()),
                                         hvd.Compression.none, 1, hvd.Adasum)
    assert type(optimizer).__name__ == "AdasumDistributedOptimizer"



def _table_and_layer() -> tuple["torch.nn.Module", "torch.nn.Module"]:
    torch.manual_seed(6)
    return torch.nn.Embedding(4, 3, sparse=True).double(), _linear(7)


def _loss(table: "torch.nn.Module", layer: "torch.nn.Module") -> "torch.Tensor":
    row = table(torch.tensor([hvd.rank() % 4]))
    return row.sum() + layer(_batch(hvd.rank(), 0).to(layer.weight.dtype)).sum()


@pytest.mark.parametrize("mismatched", ["dense", "sparse"])
def test_a_step_whose_averaging_failed_leaves_nothing_pending(mismatched: str) -> None:
    """A step that raised (here: one module float32 on rank 0 and float64 on the
    others: a MismatchError on every rank) leaves the optimizer usable once the
    cause is mended, as a caught error or an elastic retry expects: the other
    gradients' reductions were still collected, nothing is pending, zero_grad()
    and the next step work and average."""
    if hvd.size() == 1:
        pytest.skip("needs a peer to disagree with")
    table, layer = _table_and_layer()
    if hvd.rank() == 0:
        (layer if mismatched == "dense" else table).float()
    params = list(table.parameters()) + list(layer.parameters())
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.5))
    _loss(table, layer).backward()
    with pytest.raises(hvd.MismatchError, match="dtype"):
        optimizer.step()
    table.double(), layer.double()      # mended: the same dtype everywhere
    optimizer.zero_grad()               # raised "still being averaged" before the fix
    before = table.weight.detach().clone()
    _loss(table, layer).backward()
    optimizer.step()
    counts = np.bincount([r % 4 for r in range(hvd.size())], minlength=4) / hvd.size()
    expected = before - 0.5 * torch.tensor(counts)[:, None]
    np.testing.assert_allclose(table.weight.detach().numpy(), expected.numpy(), rtol=0, atol=1e-12)
    assert_identical_everywhere([p.detach().numpy() for p in params])


def test_a_failure_submitting_the_missing_gradients_leaves_nothing_pending() -> None:
    """The engine stopped while synchronize() sent zeros for the parameters this
    rank computed no gradient for: the ones already sent are still collected."""
    table, layer = _table_and_layer()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(
        list(table.parameters()) + list(layer.parameters()), lr=0.5))
    layer(_batch(hvd.rank(), 0)).sum().backward()       # the table has no gradient

    def engine_stopped(reducer: object) -> None:
        raise hvd.PeerLostError("simulated: the engine stopped")
    optimizer._start_the_rest = engine_stopped
    with pytest.raises(hvd.PeerLostError, match="simulated"):
        optimizer.step()
    del optimizer._start_the_rest
    optimizer.zero_grad()
    _loss(table, layer).backward()
    optimizer.step()
    assert_identical_everywhere([p.detach().numpy() for p in layer.parameters()])
