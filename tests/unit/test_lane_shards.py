"""A sharded optimizer's lanes (hvdlite/engine/lane.py, LaneKind): reduce-scatter and
allgather against NumPy's, segments of every size (0 included), their check words'
verdicts alike on every rank, a rank's failed part, and a join, which these lanes
refuse. Driven by hand on threads as ranks, as tests/unit/test_lane.py drives sums."""
from __future__ import annotations

import time
from typing import Any, Optional, Sequence

import numpy as np
import pytest

from hvdlite.engine.lane import CHECK_WORDS, LaneKind, LaneOp, StepMismatchError
from hvdlite.engine.lanes import Lanes
from hvdlite.errors import UsageError
from tests.unit.fake_transport import ThreadTransport, run_transports
from tests.unit.test_lane import _Handles, _serve

W = CHECK_WORDS


def _open(transport: ThreadTransport, kind: LaneKind, counts: Sequence[Sequence[int]],
          dtype: Any) -> tuple[Lanes, _Handles, int]:
    """A lane whose bucket i has ``counts[i][r]`` elements of rank r's (check words
    added to each)."""
    handles = _Handles()
    lanes = Lanes(handles.complete, handles.fail, lambda n, b: handles.reduced.append((n, b)))
    segments = [[c + W for c in each] for each in counts]
    lane_id = lanes.open("test.shards", 0, transport.lane_channel(), transport.rank,
                         transport.size, [sum(s) for s in segments], np.dtype(dtype), kind,
                         segments)
    assert lane_id is not None
    return lanes, handles, lane_id


def _scatter_op(counts: Sequence[int], values: np.ndarray, rank: int, step: int,
                scale: float = 1.0, failed: Optional[int] = None) -> LaneOp:
    """``values`` (sum(counts) elements) laid out segment by segment, words after each."""
    buf = np.zeros(sum(counts) + W * len(counts), values.dtype)
    begin = 0
    for r, count in enumerate(counts):
        at = begin + r * W
        buf[at:at + count] = values[begin:begin + count]
        begin += count
    out = np.zeros(counts[rank] + W, values.dtype)
    return LaneOp(buf, counts[rank], scale, step, "chunk", ["part"], failed, out=out)


def _gather_op(counts: Sequence[int], mine: np.ndarray, step: int,
               failed: Optional[int] = None) -> LaneOp:
    buf = np.zeros(mine.size + W, mine.dtype)
    buf[:mine.size] = mine
    out = np.zeros(sum(counts) + W * len(counts), mine.dtype)
    return LaneOp(buf, 0, 1.0, step, "chunk", ["step"], failed, out=out)


def _split(size: int, total: int) -> list[int]:
    return [total // size + (1 if r < total % size else 0) for r in range(size)]


@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("total", [0, 1, 2, 7, 31, 33, 257])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_each_rank_gets_its_segment_of_the_sum_then_every_segment(size: int, total: int,
                                                                  dtype: Any) -> None:
    """Two buckets a step for two steps: a reduce-scatter averaged, then the allgather
    of each rank's averaged segment brings the whole average back to every rank."""
    counts = [_split(size, total), [total] + [0] * (size - 1)]

    def values(rank: int, step: int, index: int) -> np.ndarray:
        rng = np.random.default_rng(1000 * step + 10 * index + rank)
        return rng.normal(size=total).astype(dtype)

    def work(transport: ThreadTransport) -> list[np.ndarray]:
        rank = transport.rank
        scatter = _open(transport, LaneKind.REDUCE_SCATTER, counts, dtype)
        gather = _open(transport, LaneKind.ALLGATHER, counts, dtype)
        wholes = []
        for step in range(2):
            ops = []
            for index, each in enumerate(counts):
                op = _scatter_op(each, values(rank, step, index), rank, step, 1.0 / size)
                op.handle = index
                scatter[0].submit(scatter[2], op)
                ops.append(op)
            _serve(scatter[0], scatter[1], {0, 1})
            assert set(scatter[1].done.values()) == {None}, scatter[1].done
            scatter[1].done.clear()
            gathered = []
            for index, (each, op) in enumerate(zip(counts, ops)):
                back = _gather_op(each, op.out[:each[rank]], step)
                back.handle = index
                gather[0].submit(gather[2], back)
                gathered.append(back)
            _serve(gather[0], gather[1], {0, 1})
            assert set(gather[1].done.values()) == {None}, gather[1].done
            gather[1].done.clear()
            for each, back in zip(counts, gathered):
                ends = np.cumsum([c + W for c in each])
                wholes.append(np.concatenate([back.out[end - W - c:end - W]
                                              for c, end in zip(each, ends)]))
        return wholes
    results = run_transports(size, work)
    for step in range(2):
        for index in range(2):
            parts = [values(r, step, index) for r in range(size)]
            expected = np.sum(parts, axis=0, dtype=dtype) * dtype(1.0 / size)
            for rank in range(size):
                np.testing.assert_array_equal(results[rank][2 * step + index], expected)


@pytest.mark.parametrize("kind", [LaneKind.REDUCE_SCATTER, LaneKind.ALLGATHER])
def test_ranks_at_different_steps_fail_on_every_rank_and_the_lane_goes_on(
        kind: LaneKind) -> None:
    counts = [2, 3, 0]

    def work(transport: ThreadTransport) -> tuple[Any, Any]:
        lanes, handles, lane_id = _open(transport, kind, [counts], np.float32)
        steps = [7, 6] if transport.rank == 1 else [7, 7]
        for handle, step in enumerate(steps):
            if kind is LaneKind.REDUCE_SCATTER:
                op = _scatter_op(counts, np.ones(5, np.float32), transport.rank, step)
            else:
                op = _gather_op(counts, np.ones(counts[transport.rank], np.float32), step)
            op.handle = handle
            lanes.submit(lane_id, op)
        _serve(lanes, handles, {0, 1})
        return handles.done[0], handles.done[1]
    what = "gathered the parameters" if kind is LaneKind.ALLGATHER else "reduced the gradients"
    for first, second in run_transports(3, work):
        assert first is None
        assert isinstance(second, StepMismatchError), second
        assert f"{what} of different steps together in bucket 'chunk'" in str(second)


def test_a_rank_whose_part_failed_fails_the_allgather_on_every_rank() -> None:
    counts = [1, 1, 1]

    def work(transport: ThreadTransport) -> Any:
        lanes, handles, lane_id = _open(transport, LaneKind.ALLGATHER, [counts], np.float64)
        failed = 0 if transport.rank == 2 else None
        op = _gather_op(counts, np.ones(1), 0, failed)
        op.handle = 0
        lanes.submit(lane_id, op)
        _serve(lanes, handles, {0})
        return handles.done[0]
    for rank, error in enumerate(run_transports(3, work)):
        assert isinstance(error, UsageError), error
        assert str(error).startswith(f"rank {rank}: rank 2's step failed, so 'chunk' "
                                     "was not gathered on any rank"), error


def test_a_joined_rank_fails_a_reduce_scatter_on_the_others_and_all_joined_is_void() -> None:
    counts = [2, 2, 2]

    def work(transport: ThreadTransport) -> Any:
        lanes, handles, lane_id = _open(transport, LaneKind.REDUCE_SCATTER, [counts],
                                        np.float32)
        lane = lanes._lanes[lane_id]
        if transport.rank != 0:
            op = _scatter_op(counts, np.ones(6, np.float32), transport.rank, 0)
            op.handle = 0
            lanes.submit(lane_id, op)
            _serve(lanes, handles, {0})
        deadline = time.monotonic() + 10
        while not lane.joined_done:
            lanes.serve(time.monotonic(), joined=True)
            assert time.monotonic() < deadline
        lanes.square_up(transport.allgather)
        return lane.started, handles.done.get(0)
    results = run_transports(3, work)
    assert {started for started, _ in results} == {1}
    for rank, (_, error) in enumerate(results[1:], start=1):
        assert isinstance(error, UsageError), error
        assert "1 rank(s) joined (hvd.join) while the others exchanged 'chunk'" in str(error)


def test_a_transport_without_the_collective_opens_no_lane() -> None:
    class SumsOnly:
        closed = False

        def start_sum(self, buf: np.ndarray) -> Any:
            raise AssertionError("never started")

        def close(self) -> None:
            SumsOnly.closed = True
    lanes = Lanes(lambda h, r: None, lambda h, e: None, lambda n, b: None)
    assert lanes.open("x", 0, SumsOnly(), 0, 2, [2 * W], np.dtype(np.float32),
                      LaneKind.ALLGATHER, [[W, W]]) is None
    assert SumsOnly.closed
