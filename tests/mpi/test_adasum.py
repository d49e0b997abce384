"""Adasum allreduce across ranks against a NumPy reference of the same
recursive combination (hvdlite.backends.adasum.tree_reference, unit-tested
against the formula), computed on every rank from every rank's deterministic
input; DistributedOptimizer(op=Adasum)'s delta semantics; and the refusals.
Meant for power-of-two sizes (np=2, 4); other sizes check the refusal only.

Tolerance: the backend accumulates dot products and norms in float64 in a
different order than the reference, then scales in the buffer's dtype, so
results agree to a few ulps of the dtype: rtol 1e-5 for float32 (and float16,
which is reduced widened to float32, then rounded: rtol 2e-3), 1e-12 for
float64, relative to the largest element.
"""
from __future__ import annotations

import numpy as np
import pytest

import hvdlite as hvd
from hvdlite.backends.adasum import is_power_of_two, tree_reference

needs_power_of_two = pytest.mark.skipif("not is_power_of_two(hvd.size())",
                                        reason="Adasum needs a power-of-two size")
TOLERANCE = {np.float16: 2e-3, np.float32: 1e-5, np.float64: 1e-12}


def _inputs(count: int, dtype: type, seed: int) -> list[np.ndarray]:
    """Every rank's input: overlapping directions, so coefficients are not trivial."""
    shared = np.random.default_rng(seed).standard_normal(count)
    return [(shared + np.random.default_rng(seed * 100 + r).standard_normal(count))
            .astype(dtype) for r in range(hvd.size())]


def _check(result: np.ndarray, inputs: list[np.ndarray], dtype: type) -> None:
    expected = tree_reference([x.astype(np.float64) for x in inputs])
    assert result.dtype == np.dtype(dtype)
    scale = max(float(np.max(np.abs(expected), initial=0.0)), 1e-30)
    np.testing.assert_allclose(result.astype(np.float64) / scale, expected / scale,
                               rtol=0, atol=TOLERANCE[dtype])


@needs_power_of_two
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64],
                         ids=lambda t: np.dtype(t).name)
@pytest.mark.parametrize("count", [1, 2, 3, 17, 1000, 300_001])
def test_allreduce_matches_the_reference(dtype: type, count: int) -> None:
    inputs = _inputs(count, dtype, seed=count)
    result = hvd.allreduce(inputs[hvd.rank()], op=hvd.Adasum,
                           name=f"adasum.{count}.{np.dtype(dtype).name}")
    _check(result, inputs, dtype)


@needs_power_of_two
def test_many_tensors_at_once_are_reduced_separately() -> None:
    """Submitted together they would be fused under Sum; Adasum's coefficients
    are per tensor, so each must match its own reference."""
    groups = [_inputs(n, np.float32, seed=50 + n) for n in (5, 64, 999)]
    handles = [hvd.allreduce_async(g[hvd.rank()], op=hvd.Adasum, name=f"adasum.many.{i}")
               for i, g in enumerate(groups)]
    for handle, inputs in zip(handles, groups):
        _check(hvd.synchronize(handle), inputs, np.float32)


@needs_power_of_two
def test_in_place_and_orthogonal_inputs_sum() -> None:
    size, rank = hvd.size(), hvd.rank()
    x = np.zeros((size, 2))
    x[rank] = [rank + 1.0, -1.0]
    hvd.allreduce_(x, op=hvd.Adasum, name="adasum.orthogonal")
    expected = np.stack([[r + 1.0, -1.0] for r in range(size)])
    np.testing.assert_allclose(x, expected, rtol=1e-15)


@needs_power_of_two
def test_equal_inputs_give_the_input_back() -> None:
    value = np.linspace(-1.0, 2.0, 33)
    np.testing.assert_allclose(hvd.allreduce(value, op=hvd.Adasum, name="adasum.equal"),
                               value, rtol=1e-12)


@needs_power_of_two
def test_process_set_of_two() -> None:
    if hvd.size() < 4:
        pytest.skip("a real subset needs 4 ranks")
    pairs = hvd.add_process_set([0, 1]), hvd.add_process_set([2, 3])
    try:
        mine = pairs[hvd.rank() // 2] if hvd.rank() < 4 else None
        if mine is not None:
            inputs = _inputs(100, np.float64, seed=9)
            members = [inputs[r] for r in mine.ranks]
            result = hvd.allreduce(inputs[hvd.rank()], op=hvd.Adasum, name="adasum.pair",
                                   process_set=mine)
            _check(result, members, np.float64)
    finally:
        for process_set in pairs:
            hvd.remove_process_set(process_set)


def test_reducescatter_refuses_adasum() -> None:
    with pytest.raises(hvd.UsageError, match="Adasum"):
        hvd.reducescatter(np.ones((hvd.size() * 2, 3)), op=hvd.Adasum, name="adasum.rs")
    # Nothing is left behind: the next collective runs.
    np.testing.assert_array_equal(hvd.allreduce(np.ones(2), op=hvd.Sum, name="adasum.after"),
                                  np.full(2, float(hvd.size())))


def test_integer_tensors_are_refused() -> None:
    with pytest.raises(hvd.UsageError, match="floating-point"):
        hvd.allreduce(np.arange(4, dtype=np.int32), op=hvd.Adasum, name="adasum.int")


def test_non_power_of_two_set_is_refused() -> None:
    if hvd.size() < 3:
        pytest.skip("a set of 3 ranks needs 3 ranks")
    # At np=3 the global set is the one of 3 ranks (it cannot be registered twice).
    three = hvd.add_process_set([0, 1, 2]) if hvd.size() > 3 else None
    try:
        if three is None or three.included():
            with pytest.raises(hvd.UsageError, match="power of two"):
                hvd.allreduce(np.ones(4), op=hvd.Adasum, name="adasum.three",
                              process_set=three)
            total = hvd.allreduce(np.ones(1), op=hvd.Sum, name="adasum.three.after",
                                  process_set=three)
            np.testing.assert_array_equal(total, [3.0])
    finally:
        if three is not None:
            hvd.remove_process_set(three)


@needs_power_of_two
def test_optimizer_reduces_the_parameter_delta_not_the_gradient() -> None:
    """Each rank steps SGD with momentum locally; the parameters must end at
    start + adasum(per-rank deltas), where the per-rank deltas are recomputed
    here from every rank's deterministic data with plain torch."""
    torch = pytest.importorskip("torch")
    import hvdlite.torch as hvdt

    def model_and_optimizer() -> tuple["torch.nn.Module", "torch.optim.Optimizer"]:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3).double()
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def local_step(model: "torch.nn.Module", opt: "torch.optim.Optimizer", r: int) -> None:
        data = torch.from_numpy(np.random.default_rng(r).standard_normal((8, 4)))
        opt.zero_grad()
        model(data).pow(2).sum().backward()
        opt.step()

    model, inner = model_and_optimizer()
    opt = hvdt.DistributedOptimizer(inner, named_parameters=model.named_parameters(),
                                    op=hvdt.Adasum)
    assert type(opt).__name__ == "AdasumDistributedOptimizer"
    start = [p.detach().clone() for p in model.parameters()]
    local_step(model, opt, hvd.rank())
    for i, param in enumerate(model.parameters()):
        deltas = []
        for r in range(hvd.size()):
            ref_model, ref_opt = model_and_optimizer()
            local_step(ref_model, ref_opt, r)
            deltas.append((list(ref_model.parameters())[i] - start[i]).detach().numpy())
        expected = start[i].numpy() + tree_reference(deltas)
        np.testing.assert_allclose(param.detach().numpy(), expected, rtol=1e-10, atol=1e-12)
    # Parameters stay identical across ranks.
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    gathered = hvd.allgather(flat[None], name="adasum.opt.same")
    np.testing.assert_array_equal(gathered, np.repeat(flat[None], hvd.size(), axis=0))


def test_optimizer_refuses_a_predivide_factor() -> None:
    torch = pytest.importorskip("torch")
    import hvdlite.torch as hvdt
    model = torch.nn.Linear(2, 1)
    for factor in (2.0, 0.5):
        with pytest.raises(hvd.UsageError, match="gradient_predivide_factor"):
            hvdt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      op=hvdt.Adasum, gradient_predivide_factor=factor)


def test_optimizer_backward_passes_and_zero_grad() -> None:
    torch = pytest.importorskip("torch")
    import hvdlite.torch as hvdt
    model = torch.nn.Linear(2, 1)

    def adasum(**settings: object) -> "torch.optim.Optimizer":
        return hvdt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         op=hvdt.Adasum, **settings)
    for passes in (0, -1):
        with pytest.raises(hvd.UsageError, match="backward_passes_per_step must be >= 1"):
            adasum(backward_passes_per_step=passes)
    opt = adasum(backward_passes_per_step=2)      # accepted: gradients accumulate until step()
    model(torch.ones(1, 2)).sum().backward()
    opt.zero_grad()                               # torch's default: gradients become None
    assert all(p.grad is None for p in model.parameters())


def test_optimizer_names_its_parameters_added_groups_included() -> None:
    torch = pytest.importorskip("torch")
    import hvdlite.torch as hvdt
    model, extra, more = torch.nn.Linear(2, 1), torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    opt = hvdt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                    named_parameters=model.named_parameters(), op=hvdt.Adasum)
    opt.add_param_group({"params": list(extra.parameters())})
    opt.add_param_group({"params": list(more.parameters())})
    names = opt._parameter_names
    assert [names[p] for p in model.parameters()] == ["weight", "bias"]
    assert [names[p] for p in extra.parameters()] == ["noname.2", "noname.3"]
    assert [names[p] for p in more.parameters()] == ["noname.4", "noname.5"]
