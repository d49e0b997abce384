"""In-place collectives write into the caller's array or tensor whatever its strides.

Protects against ranks silently diverging (or the engine dying) when ``broadcast_``,
``allreduce_``, ``grouped_allreduce_`` or their ``_async_`` forms get a transposed,
step-2 sliced or channels_last view, in the NumPy runtime and in hvdlite.torch;
``broadcast_parameters`` on a channels_last model; DistributedOptimizer on
parameters whose gradients are non-contiguous. A view whose elements share memory
(an expanded view, stride 0) cannot take a result: that is a clear error on every
rank, and the next collective still works.
"""
from __future__ import annotations

import hashlib
from typing import Any, Callable

import numpy as np
import pytest

import hvdlite as hvd
from tests.mpi.conftest import rank_data

torch = pytest.importorskip("torch")

import hvdlite.torch as hvdt  # noqa: E402

OWNER_SHAPE = (4, 6)
CHANNELS_LAST_SHAPE = (2, 3, 2, 2)
View = Callable[[Any], Any]

# owner (a contiguous 2-D array or tensor) -> the strided view an op writes into
NUMPY_VIEWS: dict[str, View] = {
    "transposed": lambda a: a.T,
    "step2_columns": lambda a: a[:, ::2],
    "step2_rows": lambda a: a[::2],
    "step2_flat": lambda a: a.reshape(-1)[::2],
    "step2_transposed": lambda a: a[:, ::2].T,
}
TORCH_VIEWS: dict[str, View] = {
    "transposed": lambda t: t.t(),
    "step2_columns": lambda t: t[:, ::2],
    "step2_rows": lambda t: t[::2],
    "step2_flat": lambda t: t.view(-1)[::2],
    "step2_transposed": lambda t: t[:, ::2].t(),
    "channels_last": lambda t: t,        # the owner itself is channels_last
}


def _root() -> int:
    return hvd.size() - 1


def _next_op_works(tag: str) -> None:
    result = hvd.allreduce(np.ones(3), op=hvd.Sum, name=f"strides.recover.{tag}")
    np.testing.assert_array_equal(result, np.full(3, float(hvd.size())))


# -- owners: every rank can rebuild every other rank's data ---------------------------
def _numpy_owner(rank: int, salt: int) -> np.ndarray:
    return rank_data(rank, OWNER_SHAPE, np.float64, salt=salt)


def _torch_owner(rank: int, salt: int, view: str,
                 dtype: "torch.dtype" = torch.float64) -> "torch.Tensor":
    if view == "channels_last":
        data = torch.from_numpy(rank_data(rank, CHANNELS_LAST_SHAPE, np.float64, salt=salt))
        return data.to(dtype=dtype, memory_format=torch.channels_last)
    return torch.from_numpy(_numpy_owner(rank, salt)).to(dtype)


def _expected_view(op: str, make_view: Callable[[int], Any]) -> Any:
    """What the view must hold afterwards: the root's values, or the sum over ranks."""
    if op.startswith("broadcast"):
        return make_view(_root())
    views = [make_view(r) for r in range(hvd.size())]
    total = views[0] * 0
    for v in views:
        total = total + v
    return total


# -- the in-place ops, in the same shape for both libraries ---------------------------
def _run_op(lib: Any, op: str, targets: list, name: str) -> list:
    """Run ``op`` of ``lib`` (hvdlite or hvdlite.torch) on ``targets``; return results."""
    if op == "broadcast_":
        return [lib.broadcast_(targets[0], _root(), name=name)]
    if op == "broadcast_async_":
        return [lib.synchronize(lib.broadcast_async_(targets[0], _root(), name=name))]
    if op == "allreduce_":
        return [lib.allreduce_(targets[0], op=hvd.Sum, name=name)]
    if op == "allreduce_async_":
        return [lib.synchronize(lib.allreduce_async_(targets[0], op=hvd.Sum, name=name))]
    if op == "grouped_allreduce_":
        return list(lib.grouped_allreduce_(targets, op=hvd.Sum, name=name))
    if op == "grouped_allreduce_async_":
        return list(lib.synchronize(lib.grouped_allreduce_async_(targets, op=hvd.Sum, name=name)))
    raise AssertionError(op)


OPS = ["broadcast_", "broadcast_async_", "allreduce_", "allreduce_async_",
       "grouped_allreduce_", "grouped_allreduce_async_"]


def _salts(op: str) -> list[int]:
    return [0, 1] if op.startswith("grouped") else [0]


# -- NumPy runtime -------------------------------------------------------------------------
@pytest.mark.timeout(30)
@pytest.mark.parametrize("view", sorted(NUMPY_VIEWS))
@pytest.mark.parametrize("op", OPS)
def test_numpy_inplace_op_writes_into_strided_view(op: str, view: str) -> None:
    make = NUMPY_VIEWS[view]
    owners = [_numpy_owner(hvd.rank(), salt) for salt in _salts(op)]
    targets = [make(o) for o in owners]
    assert not any(t.flags.c_contiguous for t in targets), "the case must be non-contiguous"
    results = _run_op(hvd, op, targets, name=f"strides.np.{op}.{view}")
    _next_op_works(f"np.{op}.{view}")     # every collective first: a failed check below
    for salt, owner, target, result in zip(_salts(op), owners, targets, results):
        expected = _expected_view(op, lambda r: make(_numpy_owner(r, salt)))
        np.testing.assert_array_equal(target, expected, err_msg="caller's view not written")
        np.testing.assert_array_equal(result, expected, err_msg="returned value")
        untouched = _numpy_owner(hvd.rank(), salt)
        make(untouched)[...] = expected
        np.testing.assert_array_equal(owner, untouched,
                                      err_msg="elements outside the view changed")


# -- hvdlite.torch ---------------------------------------------------------------------------
@pytest.mark.timeout(30)
@pytest.mark.parametrize("view", sorted(TORCH_VIEWS))
@pytest.mark.parametrize("op", OPS)
def test_torch_inplace_op_writes_into_strided_view(op: str, view: str) -> None:
    make = TORCH_VIEWS[view]
    owners = [_torch_owner(hvd.rank(), salt, view) for salt in _salts(op)]
    targets = [make(o) for o in owners]
    assert not any(t.is_contiguous() for t in targets), "the case must be non-contiguous"
    results = _run_op(hvdt, op, targets, name=f"strides.torch.{op}.{view}")
    _next_op_works(f"torch.{op}.{view}")
    for salt, owner, target, result in zip(_salts(op), owners, targets, results):
        expected = _expected_view(op, lambda r: make(_torch_owner(r, salt, view)))
        assert torch.equal(target, expected), f"caller's view not written:\n{target}\n{expected}"
        assert torch.equal(result, expected), "returned value"
        untouched = _torch_owner(hvd.rank(), salt, view)
        make(untouched).copy_(expected)
        assert torch.equal(owner, untouched), "elements outside the view changed"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "int32"])
@pytest.mark.parametrize("view", ["transposed", "channels_last"])
@pytest.mark.parametrize("op", ["broadcast_", "allreduce_"])
def test_torch_inplace_op_writes_into_strided_view_of_other_dtypes(op: str, view: str,
                                                                     dtype: str) -> None:
    make, torch_dtype = TORCH_VIEWS[view], getattr(torch, dtype)
    owner = _torch_owner(hvd.rank(), 0, view, torch_dtype)
    target = make(owner)
    assert not target.is_contiguous()
    _run_op(hvdt, op, [target], name=f"strides.torch.{op}.{view}.{dtype}")
    _next_op_works(f"torch.{op}.{view}.{dtype}")
    expected = _expected_view(op, lambda r: make(_torch_owner(r, 0, view, torch_dtype)))
    assert target.dtype == torch_dtype
    assert torch.equal(target, expected), f"caller's view not written:\n{target}\n{expected}"


@pytest.mark.timeout(30)
def test_torch_strided_broadcast_keeps_the_engine_alive() -> None:
    """The reported case: a step-2 column slice broadcast in place."""
    rank, size = hvd.rank(), hvd.size()
    owner = torch.arange(8.).reshape(2, 4) + 100 * rank
    x = owner[:, ::2]
    hvdt.broadcast_(x, 0, name="strides.reported")
    total = hvdt.allreduce(torch.ones(2), op=hvd.Sum, name="strides.reported.after")
    assert torch.equal(total, torch.full((2,), float(size)))
    assert torch.equal(x, torch.tensor([[0., 2.], [4., 6.]])), x
    assert torch.equal(owner[:, 1::2], (torch.arange(8.).reshape(2, 4) + 100 * rank)[:, 1::2])


@pytest.mark.timeout(30)
def test_numpy_strided_broadcast_keeps_the_engine_alive() -> None:
    rank, size = hvd.rank(), hvd.size()
    owner = np.arange(8.).reshape(2, 4) + 100 * rank
    hvd.broadcast_(owner[:, ::2], 0, name="strides.np.reported")
    total = hvd.allreduce(np.ones(2), op=hvd.Sum, name="strides.np.reported.after")
    np.testing.assert_array_equal(total, np.full(2, float(size)))
    expected = np.arange(8.).reshape(2, 4) + 100 * rank
    expected[:, ::2] = np.arange(8.).reshape(2, 4)[:, ::2]
    np.testing.assert_array_equal(owner, expected)


# -- views whose elements share memory: an error, not a silent result -------------------------
def _expanded_numpy() -> np.ndarray:
    row = np.arange(3.) + hvd.rank()
    return np.lib.stride_tricks.as_strided(row, shape=(4, 3), strides=(0, row.itemsize))


def _expanded_torch() -> "torch.Tensor":
    return (torch.arange(3.) + hvd.rank()).expand(4, 3)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("lib_name", ["numpy", "torch"])
@pytest.mark.parametrize("op", OPS)
def test_inplace_op_on_expanded_view_is_an_error_everywhere(lib_name: str, op: str) -> None:
    lib, make = (hvd, _expanded_numpy) if lib_name == "numpy" else (hvdt, _expanded_torch)
    targets = [make() for _ in _salts(op)]
    with pytest.raises(hvd.HvdliteError) as info:
        _run_op(lib, op, targets, name=f"strides.expanded.{lib_name}.{op}")
    assert isinstance(info.value, (TypeError, ValueError)), type(info.value).__mro__
    _next_op_works(f"expanded.{lib_name}.{op}")


# -- broadcast_parameters on a channels_last model -----------------------------------------
def _conv_model(seed: int) -> "torch.nn.Module":
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4),
                                torch.nn.ReLU(), torch.nn.Conv2d(4, 2, 2))
    return model.to(memory_format=torch.channels_last)


def _digests(tensors: dict[str, "torch.Tensor"]) -> list[str]:
    return [hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest() + k
            for k, t in sorted(tensors.items())]


@pytest.mark.timeout(30)
def test_broadcast_parameters_of_channels_last_model_makes_ranks_identical() -> None:
    model = _conv_model(seed=hvd.rank())            # every rank starts different
    weight = model[0].weight
    assert not weight.is_contiguous() and weight.is_contiguous(memory_format=torch.channels_last)
    hvdt.broadcast_parameters(model.state_dict(), root_rank=0)
    digests = hvd.allgather_object(_digests(model.state_dict()), name="strides.cl.digests")
    _next_op_works("channels_last.params")
    assert all(d == digests[0] for d in digests), "parameters differ across ranks"
    reference = _conv_model(seed=0).state_dict()
    for key, value in model.state_dict().items():
        assert torch.equal(value, reference[key]), f"'{key}' differs from rank 0's"
    assert model[0].weight.is_contiguous(memory_format=torch.channels_last)


# -- DistributedOptimizer on non-contiguous parameters -----------------------------------------
class _StridedModel(torch.nn.Module):
    """A transposed-view leaf parameter and a channels_last convolution: both have
    non-contiguous gradients, which the optimizer copies into its (contiguous) buckets."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(77)
        self.conv = torch.nn.Conv2d(3, 4, 2).double().to(memory_format=torch.channels_last)
        self.proj = torch.nn.Parameter(torch.randn(6, 4, dtype=torch.float64).t())   # (4, 6)
        self.head = torch.nn.Parameter(torch.randn(6, 8, dtype=torch.float64)[:, ::2])

    def forward(self, x: "torch.Tensor") -> "torch.Tensor":
        h = torch.tanh(self.conv(x)).mean(dim=(2, 3))        # (n, 4)
        return (h @ self.proj) @ self.head                    # (n, 4)


PER_RANK = 3


def _batch(step: int) -> tuple["torch.Tensor", "torch.Tensor"]:
    generator = torch.Generator().manual_seed(500 + step)
    total = PER_RANK * hvd.size()
    return (torch.randn(total, 3, 4, 4, generator=generator, dtype=torch.float64)
            .to(memory_format=torch.channels_last),
            torch.randn(total, 4, generator=generator, dtype=torch.float64))


def _train(distributed: bool, steps: int = 4) -> "torch.nn.Module":
    model = _StridedModel()
    optimizer: Any = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.5)
    if distributed:
        optimizer = hvdt.DistributedOptimizer(optimizer,
                                              named_parameters=model.named_parameters())
    for step in range(steps):
        optimizer.zero_grad()
        x, y = _batch(step)
        if distributed:
            mine = slice(hvd.rank() * PER_RANK, (hvd.rank() + 1) * PER_RANK)
            x, y = x[mine], y[mine]
        torch.nn.functional.mse_loss(model(x), y).backward()
        if distributed and step == 0:       # strided parameters; their gradients are
            assert not model.proj.is_contiguous(), "the case needs strided parameters"
            assert not model.conv.weight.is_contiguous()    # copied into their buckets
            if hvd.size() > 1:                 # (one rank reduces nothing: no buckets)
                assert model.proj.grad._base is not None and model.proj.grad.is_contiguous()
        optimizer.step()
    return model


@pytest.mark.timeout(40)
def test_distributed_optimizer_on_strided_parameters_matches_one_process() -> None:
    distributed = _train(distributed=True)
    digests = hvd.allgather_object(_digests(dict(distributed.named_parameters())),
                                   name="strides.optimizer.digests")
    _next_op_works("optimizer")
    assert all(d == digests[0] for d in digests), "parameters differ across ranks"
    reference = _train(distributed=False)
    for (name, p), q in zip(distributed.named_parameters(), reference.parameters()):
        assert torch.allclose(p, q, rtol=0, atol=1e-10), (name, (p - q).abs().max())
        assert p.stride() == q.stride(), (name, p.stride(), q.stride())
    start = _StridedModel()
    assert all(not torch.equal(p, q) for p, q in zip(distributed.parameters(), start.parameters()))
