"""The reducer without MPI (hvdlite.reducer): DDP's layout, the settings every
framework refuses alike, and the buckets' steps against a stand-in engine that
reduces as two ranks holding the same values would: when a bucket starts (pass
counting, groups), what goes out (one prepared request per bucket, compressed
copies, pieces around an evicted gradient, device buckets with a ready event),
what a set of one rank sends (nothing), and what an error leaves (nothing pending).
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Iterator

import numpy as np
import pytest

import hvdlite as hvd
from hvdlite.api import runtime
from hvdlite.api.adapter import NUMPY
from hvdlite.api.compression import Compression
from hvdlite.config import Config
from hvdlite.config_values import ONE_BUCKET
from hvdlite.errors import HvdliteError, UsageError
from hvdlite.reducer import buckets as reducer_module
from hvdlite.reducer.buckets import Reducer
from hvdlite.reducer.layout import cut, group_positions, plan
from hvdlite.reducer.settings import Settings
from tests.unit.stand_ins import BatchingEngine, StandInGpuAdapter, StandInGpuTensor

MIB = 1 << 20


# -- the layout ------------------------------------------------------------------------------
@pytest.mark.parametrize("count, groups, sizes", [
    (7, 3, [3, 3, 1]),      # ceil(7 / 3) consecutive parameters per group
    (6, 3, [2, 2, 2]), (6, 1, [6]),
    (3, 5, [1, 1, 1]),      # more groups than parameters: one each
    (0, 2, []),
])
def test_a_number_of_groups_splits_consecutive_parameters(count: int, groups: int,
                                                          sizes: list) -> None:
    found = group_positions(count, groups, lambda p: p)
    assert [len(g) for g in found] == sizes and sum(found, []) == list(range(count))


def test_explicit_groups_are_mapped_to_positions_and_strangers_left_out() -> None:
    where = {"x": 0, "y": 1, "z": 2}
    assert group_positions(3, [["y", "x"], ["z", "w"], ["w"]], where.get) == [[1, 0], [2]]
    assert group_positions(3, None, where.get) == []


def test_buckets_cut_at_the_cap_the_first_one_small_and_by_kind() -> None:
    sizes = [MIB // 2, MIB // 2, MIB // 2, 10 * MIB, 10 * MIB, 10 * MIB, MIB]
    kinds = ["f32"] * len(sizes)
    # The first bucket closes past 1 MiB; the others past the cap (25 MiB); in order.
    assert cut(sizes, kinds, range(7), 25 * MIB) == [[0, 1], [2, 3, 4], [5, 6]]
    # Each kind (dtype, device) has buckets of its own, each with its small first one.
    assert cut([MIB] * 6, ["f32", "f64"] * 3, range(6), 25 * MIB) == [[0], [1], [2, 4], [3, 5]]
    # No cap (a group): one bucket per kind; a cap of 0: one gradient per bucket; a cap
    # below the first bucket's size bounds it too.
    assert cut(sizes, kinds, range(7), None) == [list(range(7))]
    assert cut(sizes, kinds, [2, 0], 0) == [[2], [0]]
    assert cut([300, 300, 300], ["x"] * 3, range(3), 500) == [[0], [1], [2]]


def test_all_in_one_bucket_is_one_bucket_of_each_kind_and_the_first_not_small() -> None:
    """HVDLITE_BUCKET_BYTES=all, the default where ranks share the cores they compute on."""
    sizes = [MIB // 2, MIB // 2, MIB // 2, 10 * MIB, 10 * MIB, 10 * MIB, MIB]
    assert cut(sizes, ["f32"] * 7, range(7), ONE_BUCKET) == [list(range(7))]
    assert cut([MIB] * 6, ["f32", "f64"] * 3, range(6), ONE_BUCKET) == [[0, 2, 4], [1, 3, 5]]
    assert plan([MIB] * 6, ["f32"] * 6, ONE_BUCKET, [[1, 4]]) == [[1, 4], [5, 3, 2, 0]]
    assert Config.load({"HVDLITE_BUCKET_BYTES": "all"}).bucket_bytes == ONE_BUCKET
    assert Config.load({"HVDLITE_BUCKET_BYTES": " ALL "}).bucket_bytes == ONE_BUCKET


def test_the_plan_is_each_group_then_the_rest_in_reverse_registration_order() -> None:
    nbytes, kinds = [MIB] * 6, ["f32"] * 6
    assert plan(nbytes, kinds, 25 * MIB) == [[5], [4, 3, 2, 1, 0]]
    assert plan(nbytes, kinds, 25 * MIB, [[1, 4]]) == [[1, 4], [5], [3, 2, 0]]


# -- the settings ----------------------------------------------------------------------------
@pytest.mark.parametrize("settings, message", [
    ({"op": hvd.Sum, "predivide": 2.0}, "gradient_predivide_factor needs op=Average"),
    ({"op": hvd.Sum, "predivide": 0.5}, "gradient_predivide_factor needs op=Average"),
    ({"op": hvd.Adasum}, "op=Average or Sum"), ({"op": hvd.Min}, "op=Average or Sum"),
    ({"passes": 0}, "backward_passes_per_step must be >= 1"),
    ({"groups": 0}, "positive number of groups"),
])
def test_what_every_framework_refuses(settings: dict, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        Settings(**settings)


def test_none_compression_is_no_compression_and_average_takes_any_factor() -> None:
    assert Settings(compression=None).compression is Compression.none  # type: ignore[arg-type]
    assert Settings(op=0, predivide=0.5).op == 0          # Average given as its value
    assert Settings(op=1, passes=3).passes == 3            # Sum as its integer value


@pytest.mark.parametrize("predivide, expected", [
    (1.0, (hvd.Average, 1.0, 1.0)),                   # nothing to split
    (4.0, (hvd.Sum, 0.25, 1.0)),                      # divide by 4 before, by size/4 after
    (0.5, (hvd.Sum, 2.0, 0.125)),                     # a factor below 1 is split too
])
def test_a_predivide_factor_splits_average_around_the_sum(predivide: float,
                                                          expected: tuple) -> None:
    four = SimpleNamespace(size=lambda: 4)
    op, prescale, postscale = Settings(predivide=predivide, process_set=four).scaled_op()
    assert (int(op), prescale, postscale) == (int(expected[0]), expected[1], expected[2])


# -- a stand-in world of two ranks -----------------------------------------------------------
class _Engine(BatchingEngine):
    """Takes requests; ``wait`` reduces as two ranks with the same values would."""
    dead = None

    def __init__(self) -> None:
        super().__init__()
        self.handles = self
        self.requests: list[Any] = []
        self.markers: list[tuple[str, str]] = []     # (name, error) told to the peers
        self.failing: dict[str, HvdliteError] = {}

    def submit(self, request: Any, finish: Any = None) -> int:
        if request.desc.error:
            self.markers.append((request.desc.name, request.desc.error))
            return -1
        self.requests.append((request, finish))
        if self.current is not None:
            self.current.append(request.desc.name)
        return len(self.requests) - 1

    def wait(self, handle: int) -> Any:
        request, finish = self.requests[handle]
        desc = request.desc
        if desc.name in self.failing:
            raise self.failing[desc.name]
        factor = desc.prescale * desc.postscale * (2 if desc.op == int(hvd.Sum) else 1)
        request.output *= request.output.dtype.type(factor)
        return request.output if finish is None else finish(request.output)

    def names(self) -> list[str]:
        return [request.desc.name for request, _ in self.requests]


@pytest.fixture
def engine(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Engine]:
    made = _Engine()
    agreed: list[str] = []
    monkeypatch.setattr(runtime, "size", lambda: 2)
    monkeypatch.setattr(runtime, "rank", lambda: 0)
    monkeypatch.setattr(runtime, "engine", lambda what="": made)
    # The buckets negotiated, as with HVDLITE_LANE=0 (the lane: test_reducer_lane.py).
    monkeypatch.setattr(runtime, "config", lambda: Config.load({}, bucket_bytes=24, lane=False))
    monkeypatch.setattr(runtime, "release_host_fusion_buffer", lambda: None)
    monkeypatch.setattr(runtime.RUNTIME, "engine", made)
    monkeypatch.setattr(runtime.RUNTIME, "recorder", None)
    monkeypatch.setattr(runtime.RUNTIME, "topology", SimpleNamespace(size=2))
    made.agreed = agreed      # type: ignore[attr-defined]
    made.first_rank_names = None   # type: ignore[attr-defined]

    def check(specs: Any, what: str, process_set: Any, name: str,
              present: Any = None) -> tuple[list[str], list[bool]]:
        """The exchange's name, and the names on the set's first rank (default: ours);
        the peer has the same gradients as this rank."""
        agreed.append(name)
        made.compared = specs      # type: ignore[attr-defined]
        names = made.first_rank_names or [spec[0] for spec in specs]   # type: ignore[attr-defined]
        return names, [True] * len(specs) if present is None else list(present)

    monkeypatch.setattr(reducer_module, "agree_variables", check)
    yield made


def _specs(count: int = 4, dtype: str = "float32", device: str = "cpu") -> list:
    """``count`` parameters of 2 elements: 8 bytes each in float32."""
    return [(f"p{i}", (2,), dtype, device) for i in range(count)]


def _reducer(count: int = 4, adapter: Any = NUMPY, **settings: Any) -> Reducer:
    return Reducer(adapter, _specs(count), Settings("Opt", **settings))


def _hand_over(reducer: Reducer, positions: Any, value: float = 1.0) -> None:
    """What a hook does: the gradient into its view, then count the pass."""
    for position in positions:
        reducer.view(position)[...] += value
        reducer.ready(position)


def test_the_layout_is_agreed_once_and_buckets_named_by_their_parameters(
        engine: _Engine) -> None:
    reducer = _reducer(4)          # 8 bytes each; the first bucket 24 bytes (the cap)
    assert engine.agreed == ["Opt.layout"]     # named alike on ranks whose names differ
    assert [b.members for b in reducer.buckets] == [[3, 2, 1], [0]]
    assert [b.name for b in reducer.buckets] == ["Opt.bucket.0.p3..p1", "Opt.bucket.1.p0..p0"]
    views = [reducer.view(i) for i in (3, 2, 1)]
    assert all(v.base is reducer.buckets[0].flat for v in views)


def test_buckets_are_named_by_the_first_ranks_names_where_this_ranks_differ(
        engine: _Engine) -> None:
    """Keras numbers layers per process: a model loaded on rank 0 names its variables
    dense_2/... where a fresh one says dense/...; requests must be named alike."""
    engine.first_rank_names = ["q0", "q1", "q2", "q3"]     # type: ignore[attr-defined]
    reducer = _reducer(4)
    assert [b.name for b in reducer.buckets] == ["Opt.bucket.0.q3..q1", "Opt.bucket.1.q0..q0"]
    assert reducer.names == ["p0", "p1", "p2", "p3"]     # this rank's own, for its errors


def test_a_bucket_starts_when_its_last_gradient_has_all_its_passes(engine: _Engine) -> None:
    reducer = _reducer(4, passes=2)
    for _ in range(2):
        _hand_over(reducer, [3, 2])
        assert engine.names() == [] and reducer.pending == 0
    assert reducer.ready(1) is False and engine.names() == []
    assert reducer.ready(1) is True and engine.names() == ["Opt.bucket.0.p3..p1"]
    assert reducer.pending == 3 and reducer.unready() == [0]
    reducer.start_the_rest()           # synchronize(): the rest as it is
    assert engine.names()[1:] == ["Opt.bucket.1.p0..p0"]
    assert reducer.wait() == [] and reducer.pending == 0 and reducer.unready() == [3, 2, 1, 0]


def test_a_group_is_one_bucket_due_when_its_last_member_is_ready(engine: _Engine) -> None:
    reducer = _reducer(4, groups=[[0, 3]])
    assert [b.members for b in reducer.buckets] == [[0, 3], [2, 1]]
    _hand_over(reducer, [3, 2, 1])
    assert engine.names() == ["Opt.bucket.1.p2..p1"]
    _hand_over(reducer, [0])
    assert engine.names()[1:] == ["Opt.bucket.0.p0..p3"]


@pytest.mark.parametrize("passes", [1, 2])
def test_a_gradient_computed_once_too_often_is_refused(engine: _Engine, passes: int) -> None:
    reducer = _reducer(4, passes=passes)
    for _ in range(passes):
        _hand_over(reducer, [0])
    with pytest.raises(HvdliteError, match=rf"rank 0: the gradient of 'p0' was computed more "
                                           rf"than backward_passes_per_step={passes} times"):
        reducer.ready(0)
    _hand_over(reducer, [3, 2, 1] * passes)       # its bucket-mates still start it
    with pytest.raises(HvdliteError, match="'p3' was computed more than"):
        reducer.ready(3)                          # its bucket has started: too late


def test_each_step_resubmits_the_prepared_request_with_the_average(engine: _Engine) -> None:
    reducer = _reducer(2, predivide=4.0)
    for step in range(3):
        _hand_over(reducer, [1, 0], value=step + 1.0)
        assert reducer.wait() == []
        np.testing.assert_allclose(reducer.buckets[0].grads, np.full(4, step + 1.0))
        reducer.zero()
    first, *later = [request for request, _ in engine.requests]
    assert all(r.desc is first.desc for r in later)          # checked and described once
    assert (first.desc.op, first.desc.prescale, first.desc.postscale) == (
        int(hvd.Sum), 0.25, 2.0)


def test_a_compressed_copy_goes_on_the_wire_and_comes_back(engine: _Engine) -> None:
    reducer = _reducer(2, compression=Compression.fp16, op=hvd.Sum)
    _hand_over(reducer, [1, 0], value=1.5)
    assert reducer.wait() == []
    request, _ = engine.requests[0]
    assert request.desc.dtype == "float16" and reducer.buckets[0].flat.dtype == np.float32
    np.testing.assert_array_equal(reducer.buckets[0].grads, np.full(4, 3.0))


def test_an_evicted_gradient_leaves_its_bucket_reduced_in_the_pieces_around_it(
        engine: _Engine) -> None:
    reducer = _reducer(3)
    bucket = reducer.buckets[0]                  # [2, 1, 0]
    reducer.evict(1)                             # sparse: reduced by allgather elsewhere
    _hand_over(reducer, [2, 0], value=2.0)
    reducer.ready(1)                             # counted, not handed over
    assert engine.names() == ["Opt.bucket.0.p2..p0.part0", "Opt.bucket.0.p2..p0.part1"]
    assert reducer.pending == 2 and reducer.wait() == []
    assert [p[1].base is bucket.flat for p in bucket.pieces()] == [True, True]
    np.testing.assert_array_equal(bucket.grads, [2, 2, 0, 0, 2, 2])


def test_a_gradient_that_no_longer_fits_fails_its_bucket_on_every_rank(engine: _Engine) -> None:
    reducer = _reducer(4)
    with pytest.raises(UsageError, match=r"rank 0: the gradient of 'p2' is \(3,\) float32, "
                                         r"but its bucket was laid out for \(2,\) float32"):
        reducer.fail(2, (3,), "float32")
    assert engine.markers == [("Opt.bucket.0.p3..p1", engine.markers[0][1])]
    assert reducer.pending == 3 and reducer.wait() == [] and reducer.pending == 0


def test_a_failed_reduction_is_returned_and_the_others_still_waited_for(engine: _Engine) -> None:
    reducer = _reducer(4)
    engine.failing["Opt.bucket.0.p3..p1"] = hvd.MismatchError("dtype differs")
    _hand_over(reducer, [3, 2, 1, 0])
    errors = reducer.wait()
    assert [str(e) for e in errors] == ["dtype differs"] and reducer.pending == 0
    assert reducer.buckets[1].grads.tolist() == [1.0, 1.0]    # the other was written back
    _hand_over(reducer, [3, 2, 1, 0])                         # the next step starts clean


def test_a_list_is_packed_reduced_and_unpacked(engine: _Engine) -> None:
    reducer = Reducer(NUMPY, [("a", (2, 3), "float64", "cpu"), ("b", (), "float64", "cpu")],
                      Settings("Lists", op=hvd.Sum))
    a, b = np.arange(6.0).reshape(2, 3), np.array(7.0)
    reduced = reducer.reduce([a, b])
    np.testing.assert_array_equal(reduced[0], 2 * a)
    assert reduced[1].shape == () and float(reduced[1]) == 14.0
    assert engine.batches == [["Lists.bucket.0.b..b", "Lists.bucket.1.a..a"]]   # one round
    assert reducer.pending == 0


# -- a set of one rank -----------------------------------------------------------------------
def test_on_one_rank_nothing_is_agreed_made_or_sent(engine: _Engine, monkeypatch: Any) -> None:
    """HVDLITE_REPORT's recorder still hears what P ranks would reduce (the scaling
    forecast of a one-rank run needs it): a reduction per bucket, with its bytes."""
    monkeypatch.setattr(runtime, "size", lambda: 1)
    told: list[int] = []
    monkeypatch.setattr(runtime.RUNTIME, "recorder", SimpleNamespace(unreduced=told.append))
    reducer = _reducer(4, compression=Compression.fp16)
    assert engine.agreed == [] and all(b.flat is None for b in reducer.buckets)
    assert reducer.view(0) is None
    for position in range(4):
        reducer.ready(position)
    reducer.start_the_rest()
    assert reducer.wait() == [] and engine.requests == [] and told == [8, 24]
    grads = [np.ones(2, np.float32)] * 4
    assert all(r is g for r, g in zip(reducer.reduce(grads), grads))


def test_on_one_rank_a_predivide_factor_is_still_applied(engine: _Engine,
                                                         monkeypatch: Any) -> None:
    monkeypatch.setattr(runtime, "size", lambda: 1)
    reducer = _reducer(1, predivide=3.0)
    _hand_over(reducer, [0])
    (request, _), = engine.requests
    assert (request.desc.op, request.desc.prescale, request.desc.postscale) == (
        int(hvd.Sum), 1 / 3.0, 3.0)


# -- on a device -------------------------------------------------------------------------------
class _CountingGpuAdapter(StandInGpuAdapter):
    events = 0

    def ready_event(self, tensor: Any) -> int:
        _CountingGpuAdapter.events += 1
        return self.events


def test_device_buckets_are_one_request_each_ordered_after_the_stream(engine: _Engine) -> None:
    adapter = _CountingGpuAdapter()
    reducer = Reducer(adapter, _specs(4, device="cuda:0"), Settings("Gpu"))
    assert all(isinstance(b.flat, StandInGpuTensor) for b in reducer.buckets)
    for step in range(2):
        for position in (3, 2, 1, 0):
            reducer.view(position)[...] = position
            reducer.ready(position)
        assert reducer.wait() == []
    requests = [request for request, _ in engine.requests]
    assert [r.desc.name for r in requests] == ["Gpu.bucket.0.p3..p1", "Gpu.bucket.1.p0..p0"] * 2
    assert {r.desc.device for r in requests} == {"cuda:0"}
    readies = [r.ready for r in requests]
    assert readies == sorted(set(readies)) and None not in readies   # one per submission
    np.testing.assert_array_equal(reducer.buckets[0].grads.array, [3, 3, 2, 2, 1, 1])


# -- which gradients exist ---------------------------------------------------------------------
def test_a_bucket_carries_one_flag_per_gradient_in_its_one_request(engine: _Engine) -> None:
    """The stand-in peer has the same gradients as this rank: a gradient this rank
    lacks comes back unused (its flag summed to 0); the flags ride in the bucket's own
    request, so knowing costs no round."""
    reducer = _reducer(4)
    _hand_over(reducer, [3, 1, 0], value=2.0)
    reducer.absent(2)
    reducer.start_the_rest()
    assert reducer.wait() == [] and reducer.unused == {2}
    assert sorted(engine.names()) == ["Opt.bucket.0.p3..p1", "Opt.bucket.1.p0..p0"]
    bucket = reducer.buckets[0]
    assert bucket.flat.size == 6 + 3 and bucket.flags.tolist() == [1.0, 0.0, 1.0]
    assert bucket.grads.tolist() == [2, 2, 0, 0, 2, 2]
    _hand_over(reducer, [3, 2, 1, 0])              # the next step: every one present
    assert reducer.wait() == [] and reducer.unused == set()
    assert bucket.flags.tolist() == [1.0, 1.0, 1.0]


def test_flags_that_come_back_nonzero_say_another_rank_had_the_gradient(
        engine: _Engine, monkeypatch: Any) -> None:
    reducer = _reducer(2, op=hvd.Sum)
    wait = engine.wait

    def peer_has_everything(handle: int) -> Any:
        request, _ = engine.requests[handle]
        request.output[-2:] = 0.5                  # this rank's 0 and 1 become 1 and 2
        return wait(handle)
    monkeypatch.setattr(engine, "wait", peer_has_everything)
    reducer.absent(1)
    _hand_over(reducer, [0])
    reducer.start_the_rest()
    assert reducer.wait() == [] and reducer.unused == set()


def test_frozen_parameters_get_no_bucket_but_are_compared(engine: _Engine) -> None:
    reducer = Reducer(NUMPY, _specs(4), Settings("Opt"), trainable=[True, False, True, True])
    assert [b.members for b in reducer.buckets] == [[3, 2, 0]]
    assert not reducer.holds(1) and reducer.holds(0)
    assert [spec[3] for spec in engine.compared] == [True, False, True, True]


def test_gradients_no_rank_has_in_a_traced_graph_get_no_bucket(engine: _Engine) -> None:
    reducer = Reducer(NUMPY, _specs(3), Settings("Lists"), present=[True, False, True])
    assert reducer.never == {1} and [b.members for b in reducer.buckets] == [[2, 0]]
    grads = [np.full(2, 3.0, np.float32)] * 3
    reduced = reducer.reduce(grads)
    assert reduced[1] is grads[1] and reduced[0].tolist() == [3.0, 3.0]


def test_a_list_with_a_missing_gradient_says_which_no_rank_had(engine: _Engine) -> None:
    reducer = Reducer(NUMPY, _specs(2), Settings("Lists"))
    reducer.reduce([np.ones(2, np.float32), np.zeros(2, np.float32)], absent=[1])
    assert reducer.unused == {1}
    reducer.reduce([np.ones(2, np.float32), np.ones(2, np.float32)])
    assert reducer.unused == set()


def test_groups_and_the_layout_leave_out_what_is_not_reduced() -> None:
    assert group_positions(5, 2, lambda p: p, among=[0, 2, 3, 4]) == [[0, 2], [3, 4]]
    assert group_positions(3, [[0, 1], [2]], lambda p: p, among=[0, 2]) == [[0], [2]]
    assert plan([MIB] * 4, ["f32"] * 4, 25 * MIB, among=[0, 2, 3]) == [[3], [2, 0]]
