"""The lane (hvdlite/engine/lane.py) on threads as ranks: sums against NumPy's, the
check words' verdicts (the same on every rank), a joined rank's zeros, squaring up
after a join, closing by agreement, and the stall message. The engine's side (Lanes.serve) is driven here
by hand, as the engine thread drives it."""
from __future__ import annotations

import time
from typing import Any, Optional

import numpy as np
import pytest

from hvdlite.engine.lane import CHECK_WORDS, LaneOp, StepMismatchError, check_words
from hvdlite.engine.lanes import Lanes
from hvdlite.errors import UsageError
from tests.unit.fake_transport import ThreadTransport, run_transports


class _Handles:
    """What Lanes completes and fails, by handle."""

    def __init__(self) -> None:
        self.done: dict[int, Any] = {}
        self.reduced: list[tuple[int, int]] = []

    def complete(self, handle: int, result: Any) -> None:
        self.done[handle] = None

    def fail(self, handle: int, error: BaseException) -> None:
        self.done[handle] = error


def _open(transport: ThreadTransport, counts: list[int], dtype: Any) -> tuple[Lanes, _Handles, int]:
    handles = _Handles()
    lanes = Lanes(handles.complete, handles.fail, lambda n, b: handles.reduced.append((n, b)))
    lane_id = lanes.open("test.lane", 0, transport.lane_channel(), transport.rank,
                         transport.size, counts, np.dtype(dtype))
    return lanes, handles, lane_id


def _serve(lanes: Lanes, handles: _Handles, want: set[int], joined: bool = False) -> None:
    deadline = time.monotonic() + 10
    while not want <= set(handles.done):
        lanes.serve(time.monotonic(), joined)
        assert time.monotonic() < deadline, "the lane never completed"
        time.sleep(1e-4)


def _bucket(values: np.ndarray) -> np.ndarray:
    buf = np.zeros(values.size + CHECK_WORDS, values.dtype)
    buf[:values.size] = values
    return buf


@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("count", [0, 1, 7, 31, 33, 257])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_each_bucket_is_the_sum_times_its_scale_on_every_rank(size: int, count: int,
                                                               dtype: Any) -> None:
    def rank_values(rank: int, step: int) -> np.ndarray:
        return np.random.default_rng(100 * step + rank).normal(size=count).astype(dtype)

    def work(transport: ThreadTransport) -> list[np.ndarray]:
        lanes, handles, lane_id = _open(transport, [count + CHECK_WORDS] * 2, dtype)
        bufs = []
        for step in range(2):
            for index in range(2):
                buf = _bucket(rank_values(transport.rank, step))
                op = LaneOp(buf, count, 1.0 / size, step, f"bucket.{index}", ["g"])
                op.handle = 2 * step + index
                lanes.submit(lane_id, op)
                bufs.append(buf)
        _serve(lanes, handles, {0, 1, 2, 3})
        assert all(v is None for v in handles.done.values()), handles.done
        return [buf[:count] for buf in bufs]
    results = run_transports(size, work)
    for step in range(2):
        parts = [rank_values(r, step) for r in range(size)]
        expected = np.sum(parts, axis=0, dtype=dtype) * dtype(1.0 / size)
        for rank in range(size):
            for index in range(2):
                np.testing.assert_array_equal(results[rank][2 * step + index], expected)


def test_ranks_at_different_steps_fail_the_bucket_on_every_rank_and_the_lane_goes_on() -> None:
    def work(transport: ThreadTransport) -> tuple[Optional[BaseException], Any]:
        lanes, handles, lane_id = _open(transport, [4 + CHECK_WORDS], np.float32)
        steps = [5, 4] if transport.rank == 1 else [5, 5]
        for handle, step in enumerate(steps):
            op = LaneOp(_bucket(np.ones(4, np.float32)), 4, 1.0, step, "b", ["g"])
            op.handle = handle
            lanes.submit(lane_id, op)
        _serve(lanes, handles, {0, 1})
        return handles.done[0], handles.done[1]
    for first, second in run_transports(3, work):
        assert first is None
        assert isinstance(second, StepMismatchError), second
        assert "different steps together in bucket 'b'" in str(second)


def test_a_failed_slot_fails_every_rank_naming_the_rank_and_the_gradient() -> None:
    def work(transport: ThreadTransport) -> Any:
        lanes, handles, lane_id = _open(transport, [3 + CHECK_WORDS], np.float64)
        failed = 1 if transport.rank == 2 else None
        op = LaneOp(_bucket(np.ones(3)), 3, 1.0, 0, "b", ["w", "bias"], failed)
        op.handle = 0
        lanes.submit(lane_id, op)
        _serve(lanes, handles, {0})
        return handles.done[0]
    for rank, error in enumerate(run_transports(3, work)):
        assert isinstance(error, UsageError), error
        assert str(error).startswith(f"rank {rank}: on rank 2: the gradient of 'bias' "
                                     "no longer fits its bucket 'b'"), error


def test_a_joined_rank_sends_zeros_until_every_rank_has_joined() -> None:
    """Rank 0 joined; the others sum two buckets with its zeros (their check words
    agree among themselves), then join too: the sum of joined ranks only is void,
    and squaring up leaves every rank's lane at the same count."""
    size = 3

    def work(transport: ThreadTransport) -> Any:
        lanes, handles, lane_id = _open(transport, [2 + CHECK_WORDS], np.float64)
        if transport.rank != 0:
            for handle in range(2):
                op = LaneOp(_bucket(np.full(2, 1.0 + transport.rank)), 2, 1.0, handle, "b")
                op.handle = handle
                lanes.submit(lane_id, op)
                bufs = op.buf
            _serve(lanes, handles, {0, 1})
        lane = lanes._lanes[lane_id]
        deadline = time.monotonic() + 10
        while not lane.joined_done:          # every rank joined: one void sum
            lanes.serve(time.monotonic(), joined=True)
            assert time.monotonic() < deadline
        lanes.square_up(transport.allgather)
        return lane.started, handles.done, None if transport.rank == 0 else bufs[:2]
    results = run_transports(size, work)
    assert {started for started, _, _ in results} == {2}
    for rank, (_, done, values) in enumerate(results[1:], start=1):
        assert done == {0: None, 1: None}
        np.testing.assert_array_equal(values, np.full(2, 2.0 + 3.0))   # rank 0 sent zeros


def test_check_words_are_bits_then_counts() -> None:
    words = np.zeros(CHECK_WORDS)
    check_words(5, 3, 6, 1, False, words)
    assert words[:3].tolist() == [1, 0, 1] and words[16:18].tolist() == [1, 1]
    assert words[-6:].tolist() == [1, 7, 2, 0, 0, 0]
    check_words(5, 3, 6, None, True, words)
    assert words.tolist() == [0] * (CHECK_WORDS - 3) + [1, 0, 0]
    check_words(5, 3, 6, None, True, words, closed=True)    # closing: not joined
    assert words.tolist() == [0] * (CHECK_WORDS - 2) + [1, 7]


def test_a_sum_waiting_past_the_stall_times_is_logged_then_a_stall(
        caplog: pytest.LogCaptureFixture) -> None:
    def work(transport: ThreadTransport) -> Any:
        lanes, handles, lane_id = _open(transport, [1 + CHECK_WORDS], np.float32)
        if transport.rank == 0:                # rank 1 never takes part
            op = LaneOp(_bucket(np.ones(1, np.float32)), 1, 1.0, 3, "the.bucket")
            lanes.submit(lane_id, op)
            now = time.monotonic()
            lanes.serve(now, False)
            warned = lanes.stalls(now + 61, 60.0, 0.0)
            stalled = lanes.stalls(now + 121, 60.0, 120.0)
            return warned, stalled
        return None, None
    warned, stalled = run_transports(2, work)[0]
    assert warned is None and "bucket 'the.bucket' (step 3" in str(stalled)
    assert any("has waited 61 s" in r.getMessage() for r in caplog.records)


def test_a_shutdown_leaves_to_finish_what_every_shutting_rank_finished() -> None:
    """The counts a shutdown's verdict carries: by lane, the fewest any rank that shut
    down finished; a lane one of them never had, none."""
    from hvdlite.engine.lanes import shared_counts
    assert shared_counts([{(0, 0): 3, (0, 1): 1}, {(0, 0): 2}]) == {(0, 0): 2}
    assert shared_counts([{(0, 0): 3}]) == {(0, 0): 3}
    assert shared_counts([]) == {} and shared_counts([None, {(0, 0): 1}]) == {}

    def work(transport: ThreadTransport) -> Any:
        lanes, handles, lane_id = _open(transport, [1 + CHECK_WORDS], np.float32)
        op = LaneOp(_bucket(np.ones(1, np.float32)), 1, 1.0, 0, "b")
        op.handle = 0
        lanes.submit(lane_id, op)
        lanes.serve(time.monotonic(), False)
        before = lanes.counts(), lanes.behind({(0, 0): 1})
        _serve(lanes, handles, {0})
        return before, lanes.counts(), lanes.behind({(0, 0): 1})
    for (counts, behind), after, behind_after in run_transports(2, work):
        assert counts in ({(0, 0): 0}, {(0, 0): 1})   # the first Test may finish it
        assert behind == (counts == {(0, 0): 0})
        assert after == {(0, 0): 1} and not behind_after


def _serve_until(lanes: Lanes, done: Any, joined: bool = False) -> None:
    deadline = time.monotonic() + 10
    while not done():
        lanes.serve(time.monotonic(), joined)
        assert time.monotonic() < deadline, "the lanes never got there"
        time.sleep(1e-4)


def test_a_lane_closed_on_one_rank_is_freed_only_once_every_rank_closed_it() -> None:
    """Rank 0 closes the lane (its optimizer was freed) while the others still hold it
    and join: rank 0's zeros stand in beside theirs (void sums), and no rank frees the
    channel until the others close it too; then every rank frees it after the same
    sum."""
    size = 3

    def work(transport: ThreadTransport) -> Any:
        lanes, handles, lane_id = _open(transport, [2 + CHECK_WORDS], np.float32)
        lane = lanes._lanes[lane_id]
        if transport.rank == 0:
            lanes.close(lane_id)
            lanes.serve(time.monotonic(), False)
            assert lanes.closed and not lanes.busy     # waits, but nobody waits on it
            assert not lanes.submit(lane_id, LaneOp(_bucket(np.ones(2, np.float32)), 2,
                                                    1.0))   # takes nothing more
        else:
            _serve_until(lanes, lambda: lane.joined_done, joined=True)
        held_after_join = lanes.held
        transport.allgather(None)                   # every rank past its join
        if transport.rank != 0:
            lanes.close(lane_id)
        _serve_until(lanes, lambda: not lanes.held)
        return held_after_join, lane.channel.closed, lane.started, handles.done
    for held, channel_closed, started, done in run_transports(size, work):
        assert held == 1 and channel_closed and done == {}
        assert started == 1           # the last sum (every rank closed) was started


def test_a_sum_meeting_a_rank_that_closed_the_lane_fails_naming_that_rank() -> None:
    """Rank 1 freed its optimizer; the others still step theirs: their bucket fails
    with a UsageError naming rank 1 instead of waiting for it. Then they free theirs,
    and the lane is freed everywhere."""
    size = 3

    def work(transport: ThreadTransport) -> Any:
        lanes, handles, lane_id = _open(transport, [2 + CHECK_WORDS], np.float64)
        if transport.rank == 1:
            lanes.close(lane_id)
        else:
            op = LaneOp(_bucket(np.ones(2)), 2, 1.0, 7, "b", ["w"])
            op.handle = 0
            lanes.submit(lane_id, op)
            _serve(lanes, handles, {0})
            lanes.close(lane_id)
        _serve_until(lanes, lambda: not lanes.held)
        return handles.done.get(0)
    results = run_transports(size, work)
    assert results[1] is None
    for rank in (0, 2):
        assert isinstance(results[rank], UsageError), results[rank]
        assert str(results[rank]).startswith(
            f"rank {rank}: rank 1 closed lane 'test.lane' (its owner, an optimizer or an "
            "averager, was freed there) while this rank still uses it: bucket 'b' "
            "(step 7) was not reduced"), results[rank]


def test_a_closed_or_joined_ranks_zeros_never_stall(caplog: pytest.LogCaptureFixture) -> None:
    """Zeros that wait for the others are no bucket of this rank's: no stall warning
    however long they wait (the ranks they wait for warn of their own buckets)."""
    def work(transport: ThreadTransport) -> Any:
        lanes, handles, lane_id = _open(transport, [1 + CHECK_WORDS], np.float32)
        other_id = lanes.open("other.lane", 0, transport.lane_channel(), transport.rank,
                              2, [1 + CHECK_WORDS], np.dtype(np.float32))
        if transport.rank == 0:
            lanes.close(other_id)
            now = time.monotonic()
            lanes.serve(now, True)
            return lanes.stalls(now + 121, 60.0, 120.0), lanes.busy
        return None, None
    stalled, busy = run_transports(2, work)[0]
    assert stalled is None and busy                # a joined rank's zeros keep it busy
    assert not any("has waited" in r.getMessage() for r in caplog.records)
