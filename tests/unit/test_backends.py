"""The host backends without MPI processes: results, exact byte counts and
estimates at sizes the MPI runs do not reach (one rank, three, five), pipelined
chunks, and what each backend says it supports (found by make mutate on
hvdlite/backends; tests/unit/fake_comm.py says how the communicators behave)."""
from __future__ import annotations

import math

import numpy as np
import pytest
from mpi4py import MPI

from hvdlite.backends import mpi as mpi_backend
from hvdlite.backends import ps as ps_backend
from hvdlite.backends import ring as ring_backend
from hvdlite.backends.base import even_counts, segment_bounds
from hvdlite.backends.mpi import MpiBackend
from hvdlite.backends.ps import ParameterServerBackend
from hvdlite.backends.ring import RingBackend
from hvdlite.reduce_op import ReduceOp
from hvdlite.transport.mpi_transport import MpiTransport
from tests.unit.fake_comm import FAKE_MPI, RecordingComm, ThreadComm, run_ranks

ELEMENTWISE = [ReduceOp.SUM, ReduceOp.AVERAGE, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT]
REDUCE = {ReduceOp.SUM: np.sum, ReduceOp.AVERAGE: np.sum, ReduceOp.MIN: np.min,
          ReduceOp.MAX: np.max, ReduceOp.PRODUCT: np.prod}   # Average is a Sum here
KINDS = ["allreduce", "allgather", "broadcast", "alltoall", "reducescatter"]
F64 = np.dtype(np.float64)


@pytest.fixture(autouse=True)
def _fake_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ring and the server wait on requests through ``MPI.Request.Waitall``."""
    monkeypatch.setattr(ring_backend, "MPI", FAKE_MPI)
    monkeypatch.setattr(ps_backend, "MPI", FAKE_MPI)


def contribution(rank: int, n: int, dtype: np.dtype) -> np.ndarray:
    """Small signed integers (exact in every order of reduction), different per rank."""
    values = (np.arange(n) * (rank + 3)) % 7 - 3 + rank
    return values.astype(dtype)


def reference(size: int, n: int, dtype: np.dtype, op: ReduceOp) -> np.ndarray:
    stack = np.stack([contribution(r, n, dtype) for r in range(size)])
    return REDUCE[op](stack, axis=0).astype(dtype)


def moved(backend: object, kind: str) -> tuple[int, int]:
    counts = backend.traffic.snapshot()[kind]   # type: ignore[attr-defined]
    return counts["sent"], counts["received"]


# --- MPI's collectives: what is counted, and no MPI call where there is nothing to do

def test_mpi_supports_every_elementwise_collective_on_the_cpu_only() -> None:
    backend = MpiBackend()
    for kind in KINDS:
        assert all(backend.supports(kind, F64, "cpu", 8, op) for op in ELEMENTWISE)
        assert not backend.supports(kind, F64, "cpu", 8, ReduceOp.ADASUM)
        assert not backend.supports(kind, F64, "cuda:0", 8)
    assert backend.traffic.exact is False and backend.name == "mpi"


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("where", ["first", "second", "last"])
def test_mpi_estimates_what_a_bandwidth_optimal_algorithm_moves(size: int, where: str) -> None:
    """2N(P-1)/P each way for an allreduce of N bytes, the others' bytes for an
    allgather, a reduce-scatter and an alltoall, N from the root for a broadcast."""
    rank = {"first": 0, "second": 1, "last": size - 1}[where]
    backend = MpiBackend()
    backend.open_set(0, MpiTransport(RecordingComm(size, rank)))
    backend.allreduce(0, np.zeros(125), ReduceOp.SUM)                    # N = 1000 bytes
    estimate = 2 * 1000 * (size - 1) // size
    assert moved(backend, "allreduce") == (estimate, estimate)
    counts = [8 * (r + 1) for r in range(size)]
    backend.allgather(0, np.zeros(counts[rank], np.uint8), np.zeros(sum(counts), np.uint8),
                      counts)
    assert moved(backend, "allgather") == (sum(counts) - counts[rank],) * 2
    backend.broadcast(0, np.zeros(48, np.uint8), root=1)
    assert moved(backend, "broadcast") == ((48, 0) if rank == 1 else (0, 48))
    send = [10 * rank + r + 1 for r in range(size)]
    recv = [10 * r + rank + 1 for r in range(size)]
    backend.alltoall(0, np.zeros(sum(send), np.uint8), send, np.zeros(sum(recv), np.uint8), recv)
    assert moved(backend, "alltoall") == (sum(send) - send[rank], sum(recv) - recv[rank])
    share = even_counts(41, size)
    backend.reducescatter(0, np.zeros(41), share, np.zeros(share[rank]), ReduceOp.SUM)
    assert moved(backend, "reducescatter") == (8 * (41 - share[rank]),) * 2


def test_mpi_calls_nothing_for_one_rank_or_an_empty_buffer() -> None:
    backend, one = MpiBackend(), RecordingComm(1)
    backend.open_set(0, MpiTransport(one))
    buf = np.arange(5.0)
    backend.allreduce(0, buf, ReduceOp.SUM)
    np.testing.assert_array_equal(buf, np.arange(5.0))
    out = np.zeros(5)
    backend.allreduce_from(0, np.arange(5.0) + 1, out, ReduceOp.SUM)
    np.testing.assert_array_equal(out, np.arange(5.0) + 1)
    rs_out = np.zeros(3)
    backend.reducescatter(0, np.arange(3.0) + 2, [3], rs_out, ReduceOp.SUM)
    np.testing.assert_array_equal(rs_out, np.arange(3.0) + 2)
    backend.broadcast(0, np.zeros(4, np.uint8), root=0)
    assert one.calls == ["Ibcast"]                      # a broadcast is MPI's business
    assert "broadcast" not in backend.traffic.snapshot()  # ... but moves nothing
    two = RecordingComm(2)
    backend.open_set(1, MpiTransport(two))
    backend.allreduce(1, np.zeros(0), ReduceOp.SUM)
    assert two.calls == []
    backend.allreduce(1, np.zeros(2), ReduceOp.SUM)
    assert two.calls == ["Iallreduce"]


def test_mpi_one_rank_reducescatter_really_runs() -> None:
    """On MPI's own one-rank communicator: the reduction of one rank is its data."""
    backend = MpiBackend()
    backend.open_set(0, MpiTransport(MPI.COMM_SELF))
    out = np.zeros(4)
    backend.reducescatter(0, np.arange(4.0), [4], out, ReduceOp.MAX)
    np.testing.assert_array_equal(out, np.arange(4.0))
    mpi_backend.MpiBackend().close_set(0)               # closing an unknown set is harmless


# --- the ring: every size, pipelined chunks, exact counts

def test_ring_supports_host_reductions_from_its_threshold() -> None:
    ring = RingBackend(chunk_bytes=1 << 10, min_bytes=100)
    for kind in ("allreduce", "reducescatter"):
        assert all(ring.supports(kind, F64, "cpu", 100, op) for op in ELEMENTWISE)
        assert not ring.supports(kind, F64, "cpu", 99)
        assert not ring.supports(kind, F64, "cpu", 100, ReduceOp.ADASUM)
        assert not ring.supports(kind, F64, "cuda:0", 100)
    assert not any(ring.supports(kind, F64, "cpu", 1 << 20) for kind in
                   ("allgather", "broadcast", "alltoall"))
    assert RingBackend(1 << 10).supports("allreduce", F64, "cpu", 0)
    assert RingBackend(8).chunk_bytes == 64 and RingBackend(100).chunk_bytes == 100


@pytest.mark.parametrize("size", [1, 2, 3, 5])
@pytest.mark.parametrize("n", [0, 1, 4, 37, 100])
@pytest.mark.parametrize("dtype", [np.float64, np.int32], ids=["f64", "i32"])
def test_ring_allreduce_every_op(size: int, n: int, dtype: type) -> None:
    """In place and out of place, chunks of 64 bytes (several per segment)."""
    dtype = np.dtype(dtype)

    def work(comm: ThreadComm) -> list:
        ring = RingBackend(chunk_bytes=64)
        ring.open_set(0, MpiTransport(comm))
        results = []
        for op in ELEMENTWISE:
            buf = contribution(comm.rank, n, dtype)
            ring.allreduce(0, buf, op)
            source, out = contribution(comm.rank, n, dtype), np.full(n, 99, dtype)
            ring.allreduce_from(0, source, out, op)
            results.append((op, buf, out, source))
        return [results, ring.traffic.snapshot()["allreduce"]]
    seg = even_counts(n, size)
    for rank, (results, traffic) in enumerate(run_ranks(size, work)):
        for op, buf, out, source in results:
            np.testing.assert_array_equal(buf, reference(size, n, dtype, op), err_msg=op.name)
            np.testing.assert_array_equal(out, reference(size, n, dtype, op), err_msg=op.name)
            np.testing.assert_array_equal(source, contribution(rank, n, dtype))
        sent = 2 * n - seg[rank] - seg[(rank + 1) % size] if size > 1 else 0
        received = 2 * n - seg[rank] - seg[(rank - 1) % size] if size > 1 else 0
        calls = len(ELEMENTWISE) * 2
        assert traffic == {"calls": calls, "sent": calls * sent * dtype.itemsize,
                           "received": calls * received * dtype.itemsize}


@pytest.mark.parametrize("size, chunk_bytes", [(2, 64), (3, 64), (3, 100), (5, 256)])
def test_ring_cuts_messages_into_chunks(size: int, chunk_bytes: int) -> None:
    """Every segment travels in pieces of at most chunk_bytes, once per phase from
    every rank but one."""
    n = 203

    def work(comm: ThreadComm) -> tuple:
        ring = RingBackend(chunk_bytes=chunk_bytes)
        ring.open_set(0, MpiTransport(comm))
        buf = contribution(comm.rank, n, F64)
        ring.allreduce(0, buf, ReduceOp.SUM)
        return buf, comm.world
    results = run_ranks(size, work)
    for buf, _ in results:
        np.testing.assert_array_equal(buf, reference(size, n, F64, ReduceOp.SUM))
    pieces = [math.ceil(c / (chunk_bytes // 8)) for c in even_counts(n, size)]
    assert results[0][1].messages == 2 * (size - 1) * sum(pieces)


@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("op", ELEMENTWISE, ids=lambda op: op.name)
def test_ring_reducescatter_uneven_shares(size: int, op: ReduceOp) -> None:
    counts = [3 * r + 1 for r in range(size)]       # every rank's share differs
    n = sum(counts)

    def work(comm: ThreadComm) -> tuple:
        ring = RingBackend(chunk_bytes=64)
        ring.open_set(0, MpiTransport(comm))
        out = np.zeros(counts[comm.rank])
        ring.reducescatter(0, contribution(comm.rank, n, F64), counts, out, op)
        return out, ring.traffic.snapshot()["reducescatter"]
    full = reference(size, n, F64, op)
    for rank, (out, traffic) in enumerate(run_ranks(size, work)):
        start, end = segment_bounds(counts)[rank]
        np.testing.assert_array_equal(out, full[start:end])
        sent = n - counts[rank] if size > 1 else 0
        received = n - counts[(rank - 1) % size] if size > 1 else 0
        assert traffic == {"calls": 1, "sent": 8 * sent, "received": 8 * received}


def test_ring_scratch_grows_for_a_wider_dtype() -> None:
    """The scratch pair is reused across calls and grown when a call needs more."""
    def work(comm: ThreadComm) -> list:
        ring = RingBackend(chunk_bytes=1 << 10)
        ring.open_set(0, MpiTransport(comm))
        small = contribution(comm.rank, 50, np.dtype(np.int32))
        ring.allreduce(0, small, ReduceOp.SUM)
        large = contribution(comm.rank, 500, F64)
        ring.allreduce(0, large, ReduceOp.SUM)
        return [small, large]
    for small, large in run_ranks(3, work):
        np.testing.assert_array_equal(small, reference(3, 50, np.dtype(np.int32), ReduceOp.SUM))
        np.testing.assert_array_equal(large, reference(3, 500, F64, ReduceOp.SUM))


# --- the parameter server

def test_parameter_server_supports_host_allreduce_only() -> None:
    server = ParameterServerBackend()
    assert all(server.supports("allreduce", F64, "cpu", 8, op) for op in ELEMENTWISE)
    assert not server.supports("allreduce", F64, "cpu", 8, ReduceOp.ADASUM)
    assert not server.supports("allreduce", F64, "cuda:0", 8)
    assert not any(server.supports(kind, F64, "cpu", 8) for kind in KINDS[1:])


@pytest.mark.parametrize("size", [1, 2, 3, 5, 6])     # 6: five workers, two rounds of scratch
@pytest.mark.parametrize("n", [0, 1, 37])
def test_parameter_server_every_op_and_its_bytes(size: int, n: int) -> None:
    """The server (rank 0) moves N(P-1) bytes each way, a worker N; nothing for one
    rank or an empty buffer."""
    def work(comm: ThreadComm) -> list:
        server = ParameterServerBackend()
        server.open_set(0, MpiTransport(comm))
        results = []
        for op in ELEMENTWISE:
            buf = contribution(comm.rank, n, F64)
            server.allreduce(0, buf, op)
            source, out = contribution(comm.rank, n, F64), np.zeros(n)
            server.allreduce_from(0, source, out, op)
            results.append((op, buf, out))
        return [results, server.traffic.snapshot()["allreduce"]]
    for rank, (results, traffic) in enumerate(run_ranks(size, work)):
        for op, buf, out in results:
            np.testing.assert_array_equal(buf, reference(size, n, F64, op), err_msg=op.name)
            np.testing.assert_array_equal(out, reference(size, n, F64, op), err_msg=op.name)
        each = 8 * n * ((size - 1) if rank == 0 else 1) if size > 1 else 0
        calls = 2 * len(ELEMENTWISE)
        assert traffic == {"calls": calls, "sent": calls * each, "received": calls * each}


def test_parameter_server_reduces_in_rank_order() -> None:
    """Float sums depend on the order: the server's is rank 0, 1, 2, ... on every run."""
    size, n = 5, 64
    data = [np.random.default_rng(r).standard_normal(n) * 10.0 ** r for r in range(size)]

    def work(comm: ThreadComm) -> np.ndarray:
        server = ParameterServerBackend()
        server.open_set(0, MpiTransport(comm))
        buf = data[comm.rank].copy()
        server.allreduce(0, buf, ReduceOp.SUM)
        return buf
    expected = data[0].copy()
    for r in range(1, size):
        expected = expected + data[r]
    for buf in run_ranks(size, work):
        np.testing.assert_array_equal(buf, expected)


def test_ring_segment_of_more_than_256_chunks() -> None:
    """Past CPython's cached small integers: a piece count compared by identity
    (``is not``) instead of value would read past the last piece."""
    n = 2 * 8 * 300                                     # 300 chunks of 64 bytes per segment

    def work(comm: ThreadComm) -> np.ndarray:
        ring = RingBackend(chunk_bytes=64)
        ring.open_set(0, MpiTransport(comm))
        buf = contribution(comm.rank, n, F64)
        ring.allreduce(0, buf, ReduceOp.SUM)
        return buf
    for buf in run_ranks(2, work):
        np.testing.assert_array_equal(buf, reference(2, n, F64, ReduceOp.SUM))


def test_mpi_broadcast_root_of_a_set_beyond_256_ranks() -> None:
    """Ranks past CPython's cached small integers: the root compared by value."""
    for rank in (299, 300, 301):
        backend = MpiBackend()
        backend.open_set(0, MpiTransport(RecordingComm(400, rank)))
        backend.broadcast(0, np.zeros(16, np.uint8), root=int("300"))   # a fresh int object
        assert moved(backend, "broadcast") == ((16, 0) if rank == 300 else (0, 16))


def test_parameter_server_with_more_than_256_workers() -> None:
    """Past CPython's cached small integers: the worker count compared by value."""
    size = 258

    def work(comm: ThreadComm) -> np.ndarray:
        server = ParameterServerBackend()
        server.open_set(0, MpiTransport(comm))
        buf = np.full(2, float(comm.rank))
        server.allreduce(0, buf, ReduceOp.SUM)
        return buf
    for buf in run_ranks(size, work):
        np.testing.assert_array_equal(buf, np.full(2, float(sum(range(size)))))
