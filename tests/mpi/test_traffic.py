"""Byte counters (hvd.traffic()) and the parameter-server allreduce: the counts
are exact, so they must equal the algorithms' formulas to the byte."""
from __future__ import annotations

import numpy as np
import pytest

import hvdlite as hvd
from hvdlite.api import runtime
from hvdlite.api.control import reconfigure
from hvdlite.backends.base import even_counts
from tests.mpi.conftest import rank_data


@pytest.fixture
def algorithm(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    previous = runtime.config().allreduce
    reconfigure(allreduce=request.param)
    yield request.param
    reconfigure(allreduce=previous)


def _moved(name: str, run) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    """(sent, received) bytes counted by backend ``name`` while ``run()`` ran."""
    def counts() -> tuple[int, int]:
        kinds = hvd.traffic()["backends"][name]["kinds"]
        return (sum(k["sent"] for k in kinds.values()),
                sum(k["received"] for k in kinds.values()))
    before = counts()
    run()
    after = counts()
    return after[0] - before[0], after[1] - before[1]


@pytest.mark.parametrize("algorithm", ["ps"], indirect=True)
@pytest.mark.parametrize("elems", [1024, 1001])
def test_parameter_server_bytes(algorithm: str, elems: int) -> None:
    """The server (the set's rank 0) sends and receives N(P-1), each worker N."""
    size, nbytes = hvd.size(), elems * 4
    x = np.ones(elems, dtype=np.float32)
    sent, received = _moved("ps", lambda: hvd.allreduce_(x, op=hvd.Sum, name=f"ps.bytes.{elems}"))
    expected = nbytes * (size - 1) if hvd.rank() == 0 else nbytes
    assert (sent, received) == (expected, expected)
    np.testing.assert_array_equal(x, np.full(elems, float(size)))


@pytest.mark.parametrize("algorithm", ["ring"], indirect=True)
def test_ring_bytes_divisible(algorithm: str) -> None:
    """N divisible by P: every rank sends and receives 2N(P-1)/P."""
    size = hvd.size()
    elems = 96 * size
    x = np.ones(elems, dtype=np.float32)
    sent, received = _moved("ring", lambda: hvd.allreduce_(x, op=hvd.Sum, name="ring.bytes"))
    assert sent == received == 2 * elems * 4 * (size - 1) // size
    np.testing.assert_array_equal(x, np.full(elems, float(size)))


@pytest.mark.parametrize("algorithm", ["ring"], indirect=True)
def test_ring_bytes_not_divisible(algorithm: str) -> None:
    """Segments differ by one element: rank r sends every segment but its own and
    its right neighbour's once each, and receives every one but its left
    neighbour's and its own."""
    rank, size = hvd.rank(), hvd.size()
    elems = 50 * size + 1 if size > 1 else 7
    seg = even_counts(elems, size)
    x = np.ones(elems, dtype=np.float64)
    sent, received = _moved("ring", lambda: hvd.allreduce_(x, op=hvd.Sum, name="ring.odd"))
    if size == 1:
        assert sent == received == 0
        return
    assert sent == 8 * (2 * elems - seg[rank] - seg[(rank + 1) % size])
    assert received == 8 * (2 * elems - seg[rank] - seg[(rank - 1) % size])


def test_mpi_counts_are_marked_estimates() -> None:
    snapshot = hvd.traffic()
    assert snapshot["backends"]["mpi"]["exact"] is False
    assert all(snapshot["backends"][name]["exact"] for name in ("ring", "ps", "adasum"))
    assert snapshot["sent"] == sum(sum(k["sent"] for k in b["kinds"].values())
                                   for b in snapshot["backends"].values())


@pytest.mark.parametrize("op", [hvd.Sum, hvd.Min, hvd.Max, hvd.Product, hvd.Average],
                         ids=lambda o: hvd.ReduceOp(o).name)
def test_parameter_server_on_a_set_whose_server_is_not_rank_0(op: int) -> None:
    """The server is rank 0 of the set (global rank 1 here), not global rank 0."""
    size = hvd.size()
    if size < 3:
        pytest.skip("needs a set of at least two ranks that leaves out rank 0")
    members = list(range(1, size))
    subset = hvd.add_process_set(members)
    previous = runtime.config().allreduce
    reconfigure(allreduce="ps")
    try:
        if hvd.rank() in members:
            data = rank_data(hvd.rank(), (4, 3), np.float64, salt=int(op))
            nbytes = data.nbytes
            sent, received = _moved("ps", lambda: _check(op, data, members, subset))
            expected = nbytes * (len(members) - 1) if hvd.rank() == 1 else nbytes
            assert (sent, received) == (expected, expected)
    finally:
        reconfigure(allreduce=previous)
        hvd.remove_process_set(subset)


def _check(op: int, data: np.ndarray, members: list[int], subset: hvd.ProcessSet) -> None:
    result = hvd.allreduce(data, op=op, name=f"ps.subset.{int(op)}", process_set=subset)
    stack = np.stack([rank_data(r, data.shape, np.float64, salt=int(op)) for r in members])
    reference = {hvd.Sum: stack.sum(0), hvd.Min: stack.min(0), hvd.Max: stack.max(0),
                 hvd.Product: stack.prod(0), hvd.Average: stack.mean(0)}[op]
    np.testing.assert_allclose(result, reference)


def test_traffic_is_exported_by_every_binding() -> None:
    import hvdlite.torch as hvd_torch
    assert hvd_torch.traffic is hvd.traffic and "traffic" in hvd_torch.__all__
