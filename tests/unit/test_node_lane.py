"""The lane through the node's shared memory (hvdlite/transport/node_lane.py), with
threads as ranks: sums, reduce-scatters and allgathers started without waiting and
completed by tests, in the order started, against NumPy (sums in rank order), bitwise
alike on every rank; kept apart from the transport's own allreduce; a late peer holds
a sum back, an exited one fails it."""
from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, Optional

import numpy as np
import pytest

from hvdlite.errors import PeerLostError
from hvdlite.reduce_op import ReduceOp
from hvdlite.transport import node_lane
from hvdlite.transport.node_lane import NodeLane
from hvdlite.transport.node_memory import open_node_memory
from tests.unit.fake_transport import ThreadTransport, run_transports
from tests.unit.test_node_memory import _exited_pid, _part, _reference
from tests.unit.test_node_memory_setup import segments_held

pytestmark = pytest.mark.timeout(120)

HALF = 96      # bytes: a few elements a chunk, so most sizes span several chunks
SIZES = [0, 1, 2, 3, 7, 11, 12, 13, 31, 33, 63, 65, 97, 127, 129, 257, 1021]


def _lane(t: ThreadTransport) -> NodeLane:
    memory = open_node_memory(t, half_bytes=HALF)
    assert memory is not None
    return NodeLane(memory)


def _complete(pending: list[Any]) -> None:
    """Test every sum, the last first (as nothing orders a caller's tests), until done."""
    while not all([p.Test() for p in reversed(pending)]):
        time.sleep(0)


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
def test_sums_started_at_once_equal_numpys_sum_in_rank_order_on_every_rank(
        ranks: int, dtype: Any) -> None:
    """Every size started before any is tested: each lands in its own buffer."""
    def steps(t: ThreadTransport) -> list[bytes]:
        lane = _lane(t)
        bufs = [_part(t.rank, size, dtype, seed=size) for size in SIZES]
        _complete([lane.start_sum(buf) for buf in bufs])
        lane.close()
        return [buf.tobytes() for buf in bufs]

    results = run_transports(ranks, steps)
    for size, got in zip(SIZES, results[0]):
        want = _reference(size, ranks, dtype, ReduceOp.SUM, seed=size)
        assert got == want.tobytes(), size        # the same adds in the same order
    assert all(r == results[0] for r in results)
    assert segments_held() == []


def _counts(total: int, ranks: int, skew: str) -> list[int]:
    """Segments of ``total``: even (the remainder to the first ranks), or all on the
    last rank."""
    if skew == "last":
        return [0] * (ranks - 1) + [total]
    return [total // ranks + (k < total % ranks) for k in range(ranks)]


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("skew", ["even", "last"])
def test_reduce_scatters_and_allgathers_started_at_once_equal_numpy(
        ranks: int, dtype: Any, skew: str) -> None:
    """Every size, a reduce-scatter then an allgather of each, all started before any is
    tested: each rank's part is NumPy's sum of its segment in rank order; every rank
    gathers every segment, bitwise alike, each from its owner unchanged."""
    def steps(t: ThreadTransport) -> tuple[list[bytes], list[bytes]]:
        lane = _lane(t)
        pending, parts, gathered = [], [], []
        for size in SIZES:
            counts = _counts(size, ranks, skew)
            part = np.full(counts[t.rank], np.nan, dtype)
            pending.append(lane.start_reduce_scatter(_part(t.rank, size, dtype, seed=size),
                                                     part, counts))
            mine = _part(t.rank, counts[t.rank], dtype, seed=size + 1)
            whole = np.full(size, np.nan, dtype)
            pending.append(lane.start_allgather(mine, whole, counts))
            parts.append(part)
            gathered.append(whole)
        _complete(pending)
        lane.close()
        return [p.tobytes() for p in parts], [g.tobytes() for g in gathered]

    results = run_transports(ranks, steps)
    for i, size in enumerate(SIZES):
        counts = _counts(size, ranks, skew)
        ends = np.cumsum([0, *counts])
        summed = _reference(size, ranks, dtype, ReduceOp.SUM, seed=size)
        whole = np.concatenate([_part(r, counts[r], dtype, seed=size + 1)
                                for r in range(ranks)])
        for rank, (parts, gathered) in enumerate(results):
            assert parts[i] == summed[ends[rank]:ends[rank + 1]].tobytes(), (size, rank)
            assert gathered[i] == whole.tobytes(), (size, rank)
    assert segments_held() == []


def test_a_lanes_sums_and_the_transports_allreduces_in_between_stay_apart() -> None:
    """The lane's segments are its own: an allreduce through the transport's memory,
    run while a lane sum is still under way, changes neither."""
    def steps(t: ThreadTransport) -> tuple[bytes, bytes]:
        memory = open_node_memory(t, half_bytes=HALF)
        lane = _lane(t)
        summed = _part(t.rank, 257, np.float64, seed=1)
        pending = lane.start_sum(summed)
        other = _part(t.rank, 129, np.float64, seed=2)
        memory.allreduce(other, ReduceOp.SUM)
        _complete([pending])
        lane.close()
        memory.close()
        return summed.tobytes(), other.tobytes()

    for summed, other in run_transports(3, steps):
        assert summed == _reference(257, 3, np.float64, ReduceOp.SUM, seed=1).tobytes()
        assert other == _reference(129, 3, np.float64, ReduceOp.SUM, seed=2).tobytes()


def test_a_sum_completes_only_once_the_late_peer_starts_it() -> None:
    """Rank 0 tests its sum until rank 1 starts; rank 1 starts only after rank 0 found
    it incomplete (ordered by an event, not a sleep)."""
    found_incomplete = threading.Event()

    def steps(t: ThreadTransport) -> tuple[bool, list[float]]:
        lane = _lane(t)
        buf = np.full(40, t.rank + 1.0)
        if t.rank == 1:
            assert found_incomplete.wait(60)
            pending = lane.start_sum(buf)
            first = None
        else:
            pending = lane.start_sum(buf)
            first = pending.Test()
            found_incomplete.set()
        _complete([pending])
        lane.close()
        return bool(first), buf.tolist()

    (first, summed), (_, theirs) = run_transports(2, steps)
    assert not first
    assert summed == theirs == [3.0] * 40


def test_a_peer_that_exited_fails_the_sum_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(node_lane, "CHECK_S", 0.05)

    def steps(t: ThreadTransport) -> Optional[str]:
        memory = open_node_memory(t, half_bytes=HALF)
        assert memory is not None
        if t.rank == 1:
            return None
        memory._peers[1] = dataclasses.replace(memory._peers[1], pid=_exited_pid(), start=None)
        pending = NodeLane(memory).start_sum(np.ones(10))
        with pytest.raises(PeerLostError) as error:
            _complete([pending])
        return str(error.value)

    text = run_transports(2, steps)[0]
    assert text.startswith("rank 0: rank 1 (pid ") and "exited during an allreduce" in text
