"""Inputs a collective cannot take are clear errors on every rank, and the engine
keeps working.

Protects against two kinds of silent or confusing misbehaviour when every rank
passes the same bad input (nothing to negotiate, so each rank fails locally):

* ``alltoall`` without splits on a first dimension the set size does not divide
  (it used to split unevenly) or on a 0-d tensor (inconsistent shapes), in the
  NumPy runtime and in hvdlite.torch;
* a non-tensor (a float, a list, a NumPy array) handed to an hvdlite.torch
  collective: a TypeError that is also an HvdliteError, naming the type that was
  passed and that a torch.Tensor is expected (it used to be an AttributeError).
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest

import hvdlite as hvd

torch = pytest.importorskip("torch")

import hvdlite.torch as hvdt  # noqa: E402
from tests.mpi.outcomes import under_torchrun  # noqa: E402


def _collectives_work(tag: str) -> None:
    """A named and an unnamed collective of each kind touched here, with known results."""
    size, rank = hvd.size(), hvd.rank()
    total = hvdt.allreduce(torch.full((2,), float(rank)), op=hvd.Sum, name=f"bad_inputs.{tag}")
    assert torch.equal(total, torch.full((2,), float(sum(range(size)))))
    total = hvdt.allreduce(torch.ones(2), op=hvd.Sum)
    assert torch.equal(total, torch.full((2,), float(size)))
    received, counts = hvdt.alltoall(torch.arange(size) + 100 * rank, splits=[1] * size)
    assert torch.equal(received, torch.tensor([100 * r + rank for r in range(size)]))
    assert counts.tolist() == [1] * size


# -- alltoall without splits: the first dimension must divide evenly -----------------------
def _indivisible_rows() -> int:
    return hvd.size() + 1


ALLTOALL_BAD: dict[str, Callable[[str], Any]] = {
    "numpy.indivisible": lambda n: hvd.alltoall(np.zeros((_indivisible_rows(), 2)), name=n),
    "numpy.indivisible_async": lambda n: hvd.synchronize(
        hvd.alltoall_async(np.zeros((_indivisible_rows(), 2)), name=n)),
    "numpy.zero_dim": lambda n: hvd.alltoall(np.array(5.0), name=n),
    "torch.indivisible": lambda n: hvdt.alltoall(torch.zeros(_indivisible_rows(), 2), name=n),
    "torch.zero_dim": lambda n: hvdt.alltoall(torch.tensor(5.0), name=n),
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", sorted(ALLTOALL_BAD))
def test_alltoall_without_splits_rejects_uneven_input_everywhere(case: str) -> None:
    if hvd.size() < 2:
        pytest.skip("every first dimension divides by one rank")
    with pytest.raises((hvd.HvdliteError, ValueError)):
        ALLTOALL_BAD[case](f"bad_inputs.alltoall.{case}")
    _collectives_work(f"alltoall.{case}")


# -- non-tensor inputs to hvdlite.torch --------------------------------------------------------
BAD_VALUES: dict[str, tuple[Callable[[], Any], str]] = {   # value, its type as named
    "float": (lambda: 1.5, "float"),
    "list": (lambda: [1.0, 2.0], "list"),
    "ndarray": (lambda: np.ones(3), "ndarray"),
}

TORCH_OPS: dict[str, Callable[[Any], Any]] = {
    "allreduce": lambda x: hvdt.allreduce(x),
    "allreduce_async": lambda x: hvdt.synchronize(hvdt.allreduce_async(x)),
    "allreduce_": lambda x: hvdt.allreduce_(x),
    "allgather": lambda x: hvdt.allgather(x),
    "broadcast": lambda x: hvdt.broadcast(x, 0),
    "broadcast_": lambda x: hvdt.broadcast_(x, 0),
    "alltoall": lambda x: hvdt.alltoall(x),
    "reducescatter": lambda x: hvdt.reducescatter(x),
    "grouped_allreduce": lambda x: hvdt.grouped_allreduce([torch.ones(2), x]),
    "grouped_allreduce_": lambda x: hvdt.grouped_allreduce_([torch.ones(2), x]),
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("value", sorted(BAD_VALUES))
@pytest.mark.parametrize("op", sorted(TORCH_OPS))
def test_torch_collective_rejects_non_tensor_everywhere(op: str, value: str) -> None:
    make, type_name = BAD_VALUES[value]
    with pytest.raises(TypeError) as info:
        TORCH_OPS[op](make())
    error, message = info.value, str(info.value)
    assert isinstance(error, hvd.HvdliteError), f"{type(error).__mro__}: {message}"
    assert type_name in message, f"does not name the type passed ({type_name}): {message}"
    assert "torch.Tensor" in message, f"does not say what is accepted: {message}"
    _collectives_work(f"non_tensor.{op}.{value}")
