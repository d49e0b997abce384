"""The host backend on a transport's own collectives (hvdlite/backends/on_transport.py),
over the in-process transport at three ranks; and the MPI-based backends declining a
set opened on a transport that is no MPI communicator (what torchrun's transport is)."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from hvdlite.backends.mpi import MpiBackend
from hvdlite.backends.on_transport import TransportBackend
from hvdlite.backends.ring import RingBackend
from hvdlite.reduce_op import ReduceOp
from hvdlite.transport.base import TransportKind
from hvdlite.transport.mpi_transport import MpiTransport
from tests.unit.fake_comm import RecordingComm
from tests.unit.fake_transport import ThreadTransport, run_transports

pytestmark = pytest.mark.timeout(60)


def _on(t: ThreadTransport) -> TransportBackend:
    backend = TransportBackend()
    backend.open_set(4, t)
    return backend


def test_allreduce_average_is_a_sum_and_min_is_a_min() -> None:
    def steps(t: ThreadTransport) -> Any:
        backend = _on(t)
        total = np.array([1.0, t.rank], dtype=np.float32)
        backend.allreduce(4, total, ReduceOp.AVERAGE)       # the executor divides later
        low = np.array([t.rank + 3, 7 - t.rank], dtype=np.int64)
        backend.allreduce(4, low, ReduceOp.MIN)
        return total.tolist(), low.tolist(), backend.traffic.totals
    for total, low, (sent, received) in run_transports(3, steps, kind=TransportKind.TORCH):
        assert total == [3.0, 3.0] and low == [3, 5]
        assert sent == received == 2 * 8 * 2 // 3 + 2 * 16 * 2 // 3   # per call, as mpi counts


def test_allgather_broadcast_and_reducescatter() -> None:
    def steps(t: ThreadTransport) -> Any:
        backend = _on(t)
        counts = [1, 2, 3]
        recv = np.zeros(6, dtype=np.uint8)
        backend.allgather(4, np.full(counts[t.rank], t.rank + 1, dtype=np.uint8), recv, counts)
        buf = np.full(2, float(t.rank))
        backend.broadcast(4, buf, 2)
        out = np.zeros(counts[t.rank])
        backend.reducescatter(4, np.arange(6.0), counts, out, ReduceOp.SUM)
        return recv.tolist(), buf.tolist(), out.tolist()
    results = run_transports(3, steps, kind=TransportKind.TORCH)
    slices = [[0.0], [3.0, 6.0], [9.0, 12.0, 15.0]]
    for rank, (recv, buf, out) in enumerate(results):
        assert recv == [1, 2, 2, 3, 3, 3] and buf == [2.0, 2.0] and out == slices[rank]


def test_alltoall_sends_each_rank_its_part() -> None:
    def steps(t: ThreadTransport) -> Any:
        backend = _on(t)
        counts = [t.rank + to for to in range(3)]        # bytes to each rank; 0 from 0 to 0
        send = np.concatenate([np.full(c, 10 * t.rank + to, dtype=np.uint8)
                               for to, c in enumerate(counts)])
        recv_counts = [r + t.rank for r in range(3)]
        recv = np.zeros(sum(recv_counts), dtype=np.uint8)
        backend.alltoall(4, send, counts, recv, recv_counts)
        return recv.tolist(), backend.traffic.totals
    for rank, (recv, (sent, received)) in enumerate(run_transports(3, steps, kind=TransportKind.TORCH)):
        assert recv == [10 * r + rank for r in range(3) for _ in range(r + rank)]
        assert (sent, received) == (3 * rank + 3 - 2 * rank, 3 * rank + 3 - 2 * rank)


def test_it_serves_only_sets_opened_on_a_transport_and_only_elementwise_host_calls() -> None:
    backend = TransportBackend()
    backend.open_set(0, MpiTransport(RecordingComm(2)))                  # an MPI communicator: not ours
    assert not backend.supports("allreduce", np.dtype("f4"), "cpu", 8)
    run_transports(1, lambda t: backend.open_set(1, t), kind=TransportKind.TORCH)
    assert backend.supports("allreduce", np.dtype("f4"), "cpu", 8, ReduceOp.PRODUCT)
    assert backend.supports("reducescatter", np.dtype("f4"), "cpu", 8)
    assert backend.supports("alltoall", np.dtype("u1"), "cpu", 8)
    assert not backend.supports("allreduce", np.dtype("f4"), "cpu", 8, ReduceOp.ADASUM)
    assert not backend.supports("allreduce", np.dtype("f4"), "cuda:0", 8)
    backend.close_set(1)
    assert not backend.supports("allreduce", np.dtype("f4"), "cpu", 8)


@pytest.mark.parametrize("make", [MpiBackend, lambda: RingBackend(1 << 20)])
def test_the_mpi_backends_decline_a_set_opened_on_a_transport(make: Any) -> None:
    backend = make()
    backend.open_set(0, MpiTransport(RecordingComm(2)))
    assert backend.supports("allreduce", np.dtype("f4"), "cpu", 1 << 30)
    run_transports(1, lambda t: backend.open_set(1, t), kind=TransportKind.TORCH)
    assert not backend.supports("allreduce", np.dtype("f4"), "cpu", 1 << 30)
