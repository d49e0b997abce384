"""The reducer on a lane (hvdlite/engine/lane.py), against a stand-in engine that sums
as two ranks holding the same values would: the buckets go to the lane in index
order whatever order they are ready in, each with its check words and one scale
after the sum; the optimizer's step rides along; an evicted gradient moves the
reducer off the lane (buckets waiting for their turn too); a gradient that no longer
fits is sent failed, so every rank fails it. The negotiated path: test_reducer.py."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Iterator

import numpy as np
import pytest

import hvdlite as hvd
from hvdlite.api import runtime
from hvdlite.api.adapter import NUMPY
from hvdlite.config import Config
from hvdlite.engine.lane import CHECK_WORDS
from hvdlite.errors import UsageError
from hvdlite.negotiation.requests import Kind
from hvdlite.reducer import buckets as reducer_module
from hvdlite.reducer.buckets import Reducer
from hvdlite.reducer.settings import Settings
from tests.unit.stand_ins import BatchingEngine
from tests.unit.test_reducer import _hand_over


class _Engine(BatchingEngine):
    """Opens lane 7 for an OPEN_LANE request; records each lane op; ``wait`` sums as
    two ranks with the same values would, then scales; negotiated requests are
    recorded by name and returned as they are."""
    dead = None

    def __init__(self) -> None:
        super().__init__()
        self.handles = self
        self.ops: list[Any] = []
        self.negotiated: list[str] = []
        self.opened: list[Any] = []
        self.closed: list[int] = []

    def close_lane(self, lane_id: int) -> None:
        self.closed.append(lane_id)

    def submit(self, request: Any, finish: Any = None) -> int:
        if request.desc.kind is Kind.OPEN_LANE:
            self.opened.append(request.desc)
            return -7
        self.negotiated.append(request.desc.name)
        return -1

    def submit_lane(self, lane_id: int, op: Any) -> int:
        assert lane_id == 7
        self.ops.append(op)
        return len(self.ops) - 1

    def wait(self, handle: int) -> Any:
        if handle == -7:
            return 7
        if handle >= 0:
            op = self.ops[handle]
            op.buf[:op.scaled] *= op.buf.dtype.type(2 * op.scale)
        return None


@pytest.fixture
def engine(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Engine]:
    made = _Engine()
    monkeypatch.setattr(runtime, "size", lambda: 2)
    monkeypatch.setattr(runtime, "rank", lambda: 0)
    monkeypatch.setattr(runtime, "engine", lambda what="": made)
    monkeypatch.setattr(runtime, "config", lambda: Config.load({}, bucket_bytes=24))
    monkeypatch.setattr(runtime, "release_host_fusion_buffer", lambda: None)
    monkeypatch.setattr(runtime.RUNTIME, "engine", made)
    monkeypatch.setattr(runtime.RUNTIME, "recorder", None)
    monkeypatch.setattr(runtime.RUNTIME, "topology", SimpleNamespace(size=2))
    monkeypatch.setattr(reducer_module, "agree_variables",
                        lambda specs, *_: ([s[0] for s in specs], [True] * len(specs)))
    yield made


def _reducer(count: int = 4, dtype: str = "float32", **settings: Any) -> Reducer:
    specs = [(f"p{i}", (2,), dtype, "cpu") for i in range(count)]
    return Reducer(NUMPY, specs, Settings("Opt", **settings))


def test_the_lane_is_opened_with_the_buckets_sizes_check_words_included(
        engine: _Engine) -> None:
    reducer = _reducer(4)
    assert [b.members for b in reducer.buckets] == [[3, 2, 1], [0]]
    desc, = engine.opened
    assert desc.name == "Opt.layout.lane.p3..p0" and desc.dtype == "float32"
    assert desc.shape == (6 + 3 + CHECK_WORDS, 2 + 1 + CHECK_WORDS)
    del reducer
    assert engine.closed == [7]             # gone with its reducer


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_buckets_go_in_index_order_each_scaled_once_after_the_sum(engine: _Engine,
                                                                  dtype: str) -> None:
    reducer = _reducer(4, dtype)
    _hand_over(reducer, [0])                  # bucket 1 is ready first: it waits its turn
    assert engine.ops == []
    _hand_over(reducer, [3, 2, 1], value=3.0)
    assert [op.name for op in engine.ops] == [b.name for b in reducer.buckets]
    assert all(op.buf is b.flat for op, b in zip(engine.ops, reducer.buckets))   # no copy
    assert [op.scale for op in engine.ops] == [0.5] * len(reducer.buckets)
    assert reducer.wait() == [] and engine.negotiated == []
    for position, value in ((3, 3.0), (2, 3.0), (1, 3.0), (0, 1.0)):
        np.testing.assert_array_equal(reducer.view(position), np.full(2, value, dtype))


@pytest.mark.parametrize("settings, scale", [
    ({}, 0.5), ({"op": hvd.Sum}, 1.0), ({"predivide": 4.0}, 0.25 * 4.0 / 2)])
def test_the_scale_is_the_ops_and_the_predivide_factors_in_one(engine: _Engine,
                                                              settings: dict,
                                                              scale: float) -> None:
    reducer = _reducer(2, **settings)
    _hand_over(reducer, [1, 0])
    assert [op.scale for op in engine.ops] == [scale]


def test_the_optimizers_step_rides_along(engine: _Engine) -> None:
    reducer = _reducer(1)
    for step in (0, 1, 5):
        reducer.steps = step
        _hand_over(reducer, [0])
        assert reducer.wait() == []
    assert [op.step for op in engine.ops] == [0, 1, 5]


def test_an_evicted_gradient_moves_the_reducer_off_the_lane_with_buckets_waiting(
        engine: _Engine) -> None:
    reducer = _reducer(4)
    _hand_over(reducer, [0])                  # bucket 1 waits for bucket 0's turn
    reducer.evict(2)                          # a sparse gradient in bucket 0, this step
    _hand_over(reducer, [3, 1])
    reducer.ready(2)
    assert engine.ops == []
    assert engine.negotiated == ["Opt.bucket.1.p0..p0", "Opt.bucket.0.p3..p1.part0",
                                 "Opt.bucket.0.p3..p1.part1"]


def test_a_gradient_that_no_longer_fits_is_sent_failed(engine: _Engine) -> None:
    reducer = _reducer(4)
    with pytest.raises(UsageError, match="rank 0: the gradient of 'p2' is"):
        reducer.fail(2, (3,), "float32")
    reducer.start_the_rest()
    assert [op.failed_slot for op in engine.ops] == [1, None]


def test_float16_buckets_and_compression_are_negotiated(engine: _Engine) -> None:
    _reducer(2, "float16")
    _reducer(2, compression=hvd.Compression.fp16)
    assert engine.opened == []
