"""The Adasum backend itself, every rank a thread over tests/unit/fake_comm.py, at
1 to 8 ranks (found necessary by make mutate on hvdlite/backends/adasum.py: its MPI
stage runs at 2 ranks, where the reduce-scatter has one level, the group sums one
exchange, and the allgather one step, so a mistake in any of the loops passes).
Expected values: tree_reference over the same vectors, which the formula tests in
test_adasum.py pin down; every rank must hold bitwise the same result."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from hvdlite.backends import adasum
from hvdlite.backends.adasum import AdasumBackend, tree_reference
from hvdlite.reduce_op import ReduceOp
from hvdlite.transport.mpi_transport import MpiTransport
from tests.unit.fake_comm import ThreadComm, ThreadWorld, run_ranks

SET = 5
TOLERANCE = {np.dtype(np.float64): 1e-12, np.dtype(np.float32): 2e-5}


def _vectors(size: int, n: int, dtype: Any, seed: int = 0) -> list[np.ndarray]:
    """Correlated vectors (a shared part plus each rank's own), so the coefficients
    are far from 1 and a wrong dot product or norm shows."""
    rng = np.random.default_rng(seed + 100 * size + n)
    shared = rng.standard_normal(n)
    return [(shared + 0.5 * rng.standard_normal(n) + r).astype(dtype) for r in range(size)]


def _reduce(vectors: list[np.ndarray], repeat: int = 1) -> tuple[list[np.ndarray], list[Any]]:
    """Each rank's results of ``repeat`` Adasum allreduces of its vector, and its backend."""
    def work(comm: ThreadComm) -> tuple[list[np.ndarray], AdasumBackend]:
        backend = AdasumBackend()
        backend.open_set(SET, MpiTransport(comm))
        outs = []
        for _ in range(repeat):
            buf = vectors[comm.rank].copy()
            backend.allreduce(SET, buf, ReduceOp.ADASUM)
            outs.append(buf)
        return outs, backend
    results = run_ranks(len(vectors), work)
    return [r[0] for r in results], [r[1] for r in results]


def _check(vectors: list[np.ndarray], results: list[np.ndarray]) -> None:
    expected = tree_reference(vectors)
    for rank, result in enumerate(results):
        assert result.dtype == vectors[0].dtype and result.shape == vectors[0].shape
        assert np.array_equal(result, results[0]), f"rank {rank} differs from rank 0"
    np.testing.assert_allclose(results[0], expected, rtol=TOLERANCE[expected.dtype],
                               atol=TOLERANCE[expected.dtype])


@pytest.mark.parametrize("size", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [1, 3, 8, 13, 100])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_every_rank_gets_the_tree_of_pairwise_adasums(size: int, n: int, dtype: Any) -> None:
    vectors = _vectors(size, n, dtype)
    results, _ = _reduce(vectors)
    _check(vectors, [r[0] for r in results])


@pytest.mark.parametrize("size", [2, 4, 8])
def test_dot_products_summed_a_chunk_at_a_time(size: int,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(adasum, "_DOT_CHUNK", 3)    # several chunks, the last one short
    vectors = _vectors(size, 50, np.float64, seed=1)
    results, _ = _reduce(vectors)
    _check(vectors, [r[0] for r in results])


@pytest.mark.parametrize("size", [2, 4])
def test_a_zero_vector_on_some_ranks_adds_as_a_sum(size: int) -> None:
    vectors = _vectors(size, 9, np.float64, seed=2)
    vectors[0][:] = 0.0
    results, _ = _reduce(vectors)
    _check(vectors, [r[0] for r in results])


def test_the_scratch_buffer_serves_a_larger_then_a_smaller_tensor() -> None:
    size = 4
    big, small = _vectors(size, 40, np.float64, seed=3), _vectors(size, 6, np.float32, seed=4)
    order = (small, big, big, small)

    def work(comm: ThreadComm) -> tuple[list[np.ndarray], list[np.ndarray]]:
        backend = AdasumBackend()
        backend.open_set(SET, MpiTransport(comm))
        outs, scratch = [], []
        for vectors in order:
            buf = vectors[comm.rank].copy()
            backend.allreduce(SET, buf, ReduceOp.ADASUM)
            outs.append(buf)
            scratch.append(backend._scratch)
        return outs, scratch
    results = run_ranks(size, work)
    for index, vectors in enumerate(order):
        _check(vectors, [r[0][index] for r in results])
    for rank, (_, scratch) in enumerate(results):
        # Allocated for the largest exchange, then reused by one as large and smaller ones.
        assert scratch[1].nbytes == 20 * 8, f"rank {rank}"
        assert scratch[2] is scratch[1] and scratch[3] is scratch[1], f"rank {rank}"


@pytest.mark.parametrize("size", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [0, 1, 5, 64])
def test_traffic_counts_the_bytes_each_rank_sent(size: int, n: int) -> None:
    vectors = _vectors(size, n, np.float32, seed=5)
    world_bytes: list[int] = []

    def work(comm: ThreadComm) -> dict:
        backend = AdasumBackend()
        backend.open_set(SET, MpiTransport(comm))
        backend.allreduce(SET, vectors[comm.rank].copy(), ReduceOp.ADASUM)
        world_bytes.append(comm.world)
        return backend.traffic.snapshot()
    counts = run_ranks(size, work)
    world: ThreadWorld = world_bytes[0]
    for rank, count in enumerate(counts):
        assert count["allreduce"]["calls"] == 1
        assert count["allreduce"]["sent"] == world.sent_bytes[rank], f"rank {rank}"
        # Every exchange is a Sendrecv of equal halves: each rank receives what it sends.
        assert count["allreduce"]["received"] == world.sent_bytes[rank], f"rank {rank}"


def _sent_bytes(rank: int, size: int, n: int, itemsize: int) -> int:
    """What ``rank`` sends, from the lengths alone: at level 2^j it sends what it gives
    away of the m_j elements it holds (the rank with bit j clear keeps floor(m_j / 2),
    the other the rest), then 24 bytes (three float64 sums) to each of j + 1 partners;
    the allgather sends back what it kept at each level. In all, n + m_1 + ... + m_(k-1)
    elements."""
    held, elements, partials, level = n, 0, 0, 1
    while level < size:
        elements += held
        held = held // 2 if not rank & level else held - held // 2
        partials += level.bit_length()
        level <<= 1
    return elements * itemsize + 24 * partials


@pytest.mark.parametrize("size", [2, 4, 8])
@pytest.mark.parametrize("n", [64, 13, 7, 24])
def test_each_rank_sends_half_its_range_at_each_level(size: int, n: int) -> None:
    # Any split both partners agree on gives the right result; this pins the halving,
    # so that the work and the traffic are spread evenly over the ranks.
    vectors = _vectors(size, n, np.float32, seed=6)

    def work(comm: ThreadComm) -> tuple[dict, np.ndarray]:
        backend = AdasumBackend()
        backend.open_set(SET, MpiTransport(comm))
        buf = vectors[comm.rank].copy()
        backend.allreduce(SET, buf, ReduceOp.ADASUM)
        return backend.traffic.snapshot()["allreduce"], buf
    results = run_ranks(size, work)
    _check(vectors, [r[1] for r in results])
    expected = [_sent_bytes(rank, size, n, 4) for rank in range(size)]
    assert [r[0]["sent"] for r in results] == expected
    if n % size == 0:
        # Every rank alike: 2n(1 - 1/P) elements and 12 k (k + 1) bytes of sums, P = 2^k.
        k = size.bit_length() - 1
        assert expected == [2 * n * (size - 1) // size * 4 + 12 * k * (k + 1)] * size
    if (size, n) == (4, 7):
        assert expected == [112, 116, 112, 116]      # 3 or 4 of 7 kept at the first level


def test_a_set_that_is_not_a_power_of_two_is_refused() -> None:
    def work(comm: ThreadComm) -> None:
        backend = AdasumBackend()
        backend.open_set(SET, MpiTransport(comm))
        with pytest.raises(ValueError, match="power-of-two process set, got 3 ranks"):
            backend.allreduce(SET, np.ones(4), ReduceOp.ADASUM)
    run_ranks(3, work)


@pytest.mark.parametrize("dtype", [np.int32, np.float16, np.int64])
def test_only_float32_and_float64_buffers_are_reduced(dtype: Any) -> None:
    def work(comm: ThreadComm) -> None:
        backend = AdasumBackend()
        backend.open_set(SET, MpiTransport(comm))
        with pytest.raises(TypeError, match="float32/float64"):
            backend.allreduce(SET, np.ones(4, dtype=dtype), ReduceOp.ADASUM)
    run_ranks(2, work)


def test_the_backend_serves_only_adasum_allreduces_on_the_host() -> None:
    backend = AdasumBackend()
    f32 = np.dtype(np.float32)
    assert backend.supports("allreduce", f32, "cpu", 64, ReduceOp.ADASUM)
    assert not backend.supports("allreduce", f32, "cpu", 64, ReduceOp.SUM)
    assert not backend.supports("allreduce", f32, "cpu", 64)
    assert not backend.supports("allgather", f32, "cpu", 64, ReduceOp.ADASUM)
    assert not backend.supports("allreduce", f32, "cuda:0", 64, ReduceOp.ADASUM)
    for op in (ReduceOp.AVERAGE, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT):
        assert not backend.supports("allreduce", f32, "cpu", 64, op), op
    for kind in ("broadcast", "reducescatter", "allgather", "alltoall"):
        assert not backend.supports(kind, f32, "cpu", 64, ReduceOp.ADASUM), kind
    # A kind equal to "allreduce" but not the interned literal (built at run time).
    built = "".join(["all", "reduce"])
    assert backend.supports(built, f32, "cpu", 64, ReduceOp.ADASUM)


def test_more_ranks_than_python_caches_small_ints_for() -> None:
    # 512 ranks: the level and the size are equal ints but not the same object.
    size = 512
    vectors = _vectors(size, 3, np.float64, seed=7)
    results, _ = _reduce(vectors)
    _check(vectors, [r[0] for r in results])
