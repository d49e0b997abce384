"""Horovod names of the torch and TensorFlow bindings that scripts use: torch's
``DistributedOptimizer(num_groups=n)`` (Horovod's older spelling of ``groups=n``, in its
position) and ``hvdlite.tensorflow.broadcast_object_fn``."""
from __future__ import annotations

import numpy as np
import pytest

import hvdlite as hvd


def _trained(**grouping: object) -> list[np.ndarray]:
    torch = pytest.importorskip("torch")
    import hvdlite.torch as hvd_torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    positional = grouping.pop("positional", None)
    wrapped = torch.optim.SGD(model.parameters(), lr=0.1)
    if positional is not None:    # Horovod's order: ..., gradient_predivide_factor, num_groups
        optimizer = hvd_torch.DistributedOptimizer(
            wrapped, model.named_parameters(), hvd.Compression.none, 1, hvd.Average, 1.0,
            positional)
    else:
        optimizer = hvd_torch.DistributedOptimizer(
            wrapped, named_parameters=model.named_parameters(), **grouping)
    torch.manual_seed(10 + hvd.rank())
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(4, 6)).pow(2).mean().backward()
        optimizer.step()
    return [p.detach().numpy().copy() for p in model.parameters()]


@pytest.mark.parametrize("how", [{"num_groups": 2}, {"positional": 2}])
def test_num_groups_is_groups(how: dict) -> None:
    """The same parameters as groups=2, and the same on every rank."""
    expected = _trained(groups=2)
    got = _trained(**how)
    for a, b in zip(expected, got):
        np.testing.assert_array_equal(a, b)
    digests = hvd.allgather_object([a.tobytes() for a in got], name="num_groups.same")
    assert all(d == digests[0] for d in digests)


def test_groups_wins_over_num_groups() -> None:
    torch = pytest.importorskip("torch")
    import hvdlite.torch as hvd_torch
    model = torch.nn.Linear(3, 1)
    optimizer = hvd_torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                               num_groups=3, groups=1)
    assert optimizer._settings.groups == 1


def test_broadcast_object_fn_returns_a_function_that_broadcasts() -> None:
    pytest.importorskip("tensorflow")
    import hvdlite.tensorflow as hvd_tf
    root = hvd.size() - 1
    broadcast = hvd_tf.broadcast_object_fn(root_rank=root, name="objects")
    assert broadcast({"from": hvd.rank(), "data": [hvd.rank()] * 3}) == {
        "from": root, "data": [root] * 3}
    assert broadcast(("again", hvd.rank())) == ("again", root)     # reusable
    default = hvd_tf.broadcast_object_fn()
    assert default(hvd.rank()) == 0
    assert "broadcast_object_fn" in hvd_tf.__all__
