"""What every host backend shares (hvdlite/backends/base.py): the byte counter,
the persistent scratch pair, the widened half types, the default out-of-place
allreduce, and the segment arithmetic (found by make mutate on backends/base.py)."""
from __future__ import annotations

from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest

from hvdlite.backends.base import (DONE, UFUNCS, HostBackend, ScratchPair, Traffic, even_counts,
                                   offsets, segment_bounds, widened_dtype)
from hvdlite.reduce_op import ReduceOp
from hvdlite.transport.base import TransportKind


def test_traffic_counts_calls_and_bytes_per_kind_and_in_total() -> None:
    traffic = Traffic()
    assert traffic.exact is True and traffic.totals == (0, 0) and traffic.snapshot() == {}
    traffic.add("allreduce", 10, 20)
    traffic.add("allreduce", np.int64(3), 4)           # numpy integers are stored as int
    traffic.add("broadcast", 0, 7)
    assert traffic.snapshot() == {"allreduce": {"calls": 2, "sent": 13, "received": 24},
                                  "broadcast": {"calls": 1, "sent": 0, "received": 7}}
    assert traffic.totals == (13, 31)
    assert all(type(v) is int for k in traffic.snapshot().values() for v in k.values())
    assert Traffic(exact=False).exact is False


def test_a_traffic_snapshot_is_a_copy() -> None:
    traffic = Traffic()
    traffic.add("allgather", 1, 1)
    snapshot = traffic.snapshot()
    traffic.add("allgather", 1, 1)
    assert snapshot["allgather"]["calls"] == 1 and traffic.snapshot()["allgather"]["calls"] == 2


def test_done_is_finished_work() -> None:
    assert DONE.done() is True and DONE.wait() is None


def test_reductions_of_the_host_backends() -> None:
    assert UFUNCS == {ReduceOp.SUM: np.add, ReduceOp.AVERAGE: np.add,
                      ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum,
                      ReduceOp.PRODUCT: np.multiply}


@pytest.mark.parametrize("dtype, wide", [
    (np.float16, np.float32), (ml_dtypes.bfloat16, np.float32), (np.float32, np.float32),
    (np.float64, np.float64), (np.int8, np.int8), (np.int64, np.int64), (np.bool_, np.bool_)])
def test_host_backends_reduce_half_types_in_float32(dtype: type, wide: type) -> None:
    assert widened_dtype(dtype) == np.dtype(wide)
    assert HostBackend().reduction_dtype(np.dtype(dtype)) == np.dtype(wide)


class _Recording(HostBackend):
    def allreduce(self, set_id: int, buf: np.ndarray, op: ReduceOp) -> object:
        self.seen = (set_id, buf.copy(), op)
        buf *= 2
        return DONE


def test_default_allreduce_from_copies_then_reduces_in_place() -> None:
    backend = _Recording()
    source, out = np.arange(4.0), np.full(4, -1.0)
    assert backend.allreduce_from(3, source, out, ReduceOp.MAX) is DONE
    set_id, seen, op = backend.seen
    assert set_id == 3 and op is ReduceOp.MAX
    np.testing.assert_array_equal(seen, np.arange(4.0))
    np.testing.assert_array_equal(out, 2 * np.arange(4.0))
    np.testing.assert_array_equal(source, np.arange(4.0))


def test_sets_open_and_close() -> None:
    backend, comm = HostBackend(), object()
    backend.open_set(5, SimpleNamespace(kind=TransportKind.MPI, comm=comm))
    assert backend._comms == {5: comm} and not backend.declined
    backend.close_set(5)
    backend.close_set(5)                       # twice, or a set never opened: harmless
    assert backend._comms == {}
    assert HostBackend().traffic.exact is True and HostBackend().name == "host"


def test_a_set_on_a_transport_of_another_kind_is_declined() -> None:
    backend = HostBackend()
    backend.open_set(0, SimpleNamespace(kind=TransportKind.TORCH))
    assert backend.declined and backend._comms == {}


def test_scratch_pair_is_two_disjoint_persistent_buffers() -> None:
    scratch = ScratchPair()
    first, second = scratch.pair(np.dtype(np.float64), 10)
    assert first.dtype == second.dtype == np.float64 and first.size == second.size == 10
    assert not np.shares_memory(first, second)
    first[:], second[:] = 1.0, 2.0                  # writing one never touches the other
    assert (first == 1.0).all() and (second == 2.0).all()
    again = scratch.pair(np.dtype(np.float64), 10)
    assert np.shares_memory(again[0], first) and np.shares_memory(again[1], second)
    narrower = scratch.pair(np.dtype(np.int32), 20)     # the same bytes: no new buffer
    assert np.shares_memory(narrower[0], first) and narrower[0].size == 20
    grown = scratch.pair(np.dtype(np.float64), 11)
    assert grown[0].size == grown[1].size == 11 and not np.shares_memory(grown[0], first)
    assert not np.shares_memory(grown[0], grown[1])
    smaller = scratch.pair(np.dtype(np.float64), 4)     # a smaller pair keeps the buffer
    assert smaller[0].size == smaller[1].size == 4
    assert np.shares_memory(smaller[0], grown[0]) and np.shares_memory(smaller[1], grown[0])
    assert not np.shares_memory(smaller[0], smaller[1])


def test_an_empty_scratch_pair() -> None:
    first, second = ScratchPair().pair(np.dtype(np.float32), 0)
    assert first.size == second.size == 0 and first.dtype == np.float32


@pytest.mark.parametrize("total, parts, counts", [
    (10, 4, [3, 3, 2, 2]), (7, 3, [3, 2, 2]), (2, 4, [1, 1, 0, 0]), (0, 3, [0, 0, 0]),
    (9, 3, [3, 3, 3]), (5, 1, [5])])
def test_even_counts_puts_the_remainder_first(total: int, parts: int, counts: list) -> None:
    assert even_counts(total, parts) == counts


def test_segments_and_offsets() -> None:
    assert segment_bounds([]) == [] and offsets([]) == []
    assert segment_bounds([4]) == [(0, 4)]
    assert segment_bounds([2, 0, 3, 1]) == [(0, 2), (2, 2), (2, 5), (5, 6)]
    assert offsets([2, 0, 3, 1]) == [0, 2, 2, 5]
