"""The gradient bookkeeping shared by every framework's optimizer, without MPI:
how parameters are split into groups, when a group is due for reduction, which
settings are refused, what a set of one rank sends, and when GPU gradients leave
their bucket (stand-in ops, engine and a stand-in GPU tensor record it all)."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Optional

import numpy as np
import pytest

import hvdlite as hvd
from hvdlite.api import adapter as adapters
from hvdlite.api import runtime
from hvdlite.api.compression import Compression
from hvdlite.api.gradients import AveragerSettings, GradientReducer, check_settings, plan_groups
from hvdlite.config import Config
from hvdlite.errors import HvdliteError, UsageError
from tests.unit.stand_ins import BatchingEngine, StandInGpuAdapter, StandInGpuTensor


@pytest.mark.parametrize("keys, groups, sizes", [
    (list("abcdefg"), 3, [3, 3, 1]),      # ceil(7 / 3) consecutive keys per group
    (list("abcdef"), 3, [2, 2, 2]),
    (list("abcdef"), 1, [6]),
    (list("abc"), 5, [1, 1, 1]),          # more groups than keys: one key each
    (list("abcdefgh"), 3, [3, 3, 2]),
])
def test_a_number_of_groups_splits_consecutive_keys(keys: list, groups: int,
                                                     sizes: list) -> None:
    group_of, members = plan_groups(keys, groups)
    assert [len(m) for m in members] == sizes
    assert [k for m in members for k in m] == keys
    assert all(group_of[k] == g for g, m in enumerate(members) for k in m)


@pytest.mark.parametrize("groups", [0, -1])
def test_no_positive_number_of_groups_is_refused(groups: int) -> None:
    with pytest.raises(UsageError, match="positive number of groups"):
        plan_groups(list("abc"), groups)


def test_explicit_groups_are_mapped_by_key_and_none_means_no_groups() -> None:
    group_of, members = plan_groups(["x", "y", "z"], [["Y", "X"], ["Z"]], key_of=str.lower)
    assert members == [["y", "x"], ["z"]] and group_of == {"y": 0, "x": 0, "z": 1}
    assert plan_groups(["x"], None) == ({}, [])


def _reducer(groups: object, passes: int = 1) -> GradientReducer:
    keys = list("abcde")
    ops = {"allreduce_async_": None, "synchronize": None}
    return GradientReducer(ops, {k: k for k in keys}, Compression.none, passes, hvd.Average,
                           1.0, None, plan_groups(keys, groups))


def test_a_group_is_due_when_its_last_member_is_ready() -> None:
    reducer = _reducer(2)                 # groups [a, b, c] and [d, e]
    assert reducer.ready("a") == [] and reducer.ready("c") == []
    assert reducer.ready("d") == []
    assert reducer.ready("b") == ["a", "b", "c"]
    assert reducer.ready("e") == ["d", "e"]
    ungrouped = _reducer(None)
    assert ungrouped.ready("b") == ["b"]  # no groups: each key as it is ready


def test_with_several_passes_a_key_counts_once_it_has_them_all() -> None:
    reducer = _reducer(1, passes=2)       # one group of all five
    for key in "abcd":
        assert reducer.ready(key) == []   # first pass
        assert reducer.ready(key) == []   # second: ready, the group is not complete
    assert reducer.ready("e") == []
    assert reducer.ready("e") == list("abcde")
    reducer.reset()
    assert reducer.ready("a") == []       # a new step counts from zero


class _FourRanks:
    def size(self) -> int:
        return 4


@pytest.mark.parametrize("predivide, expected", [
    (1.0, (hvd.Average, 1.0, 1.0)),                    # nothing to split
    (4.0, (hvd.Sum, 0.25, 1.0)),                       # divide by 4 before, by size/4 after
    (0.5, (hvd.Sum, 2.0, 0.125)),                      # a factor below 1 is split too
])
def test_a_predivide_factor_splits_average_around_the_sum(predivide: float,
                                                          expected: tuple) -> None:
    from hvdlite.api.gradients import scaled_op
    op, prescale, postscale = scaled_op(hvd.Average, predivide, _FourRanks())
    assert (int(op), prescale, postscale) == (int(expected[0]), expected[1], expected[2])


# -- the settings every framework refuses alike ---------------------------------------------

@pytest.mark.parametrize("factor", [0.5, 2.0])      # below 1 and above 1
def test_a_predivide_factor_needs_average(factor: float) -> None:
    with pytest.raises(UsageError, match="gradient_predivide_factor needs op=Average"):
        check_settings(1, hvd.Sum, factor)
    with pytest.raises(UsageError, match="gradient_predivide_factor needs op=Average"):
        AveragerSettings("DistributedGradientTape", op=hvd.Sum, predivide=factor)


@pytest.mark.parametrize("op", [hvd.Min, hvd.Max, hvd.Product, hvd.Adasum])
def test_gradients_are_reduced_with_average_or_sum_only(op: int) -> None:
    with pytest.raises(UsageError, match="op=Average or Sum"):
        check_settings(1, op, 1.0)


@pytest.mark.parametrize("op", [hvd.Average, 0])    # 0: Average given as its integer value
@pytest.mark.parametrize("factor", [0.5, 1.0, 2.0])
def test_average_takes_any_predivide_factor_and_sum_none(op: int, factor: float) -> None:
    check_settings(1, op, factor)
    check_settings(3, hvd.Sum, 1.0)
    check_settings(1, 1, 1.0)                        # Sum as its integer value


def test_an_averager_keeps_its_compression_and_has_horovods_defaults() -> None:
    assert AveragerSettings("x", compression=Compression.fp16).compression is Compression.fp16
    unset = AveragerSettings("x", compression=None)  # type: ignore[arg-type]
    assert unset.compression is Compression.none
    # A DistributedGradientTape's defaults (every binding in the tree passes them
    # explicitly, but the dataclass is what a new binding builds on).
    settings = AveragerSettings("x")
    assert (settings.compression, settings.sparse_as_dense, settings.op, settings.predivide,
            settings.groups, settings.process_set) == (
        Compression.none, False, hvd.Average, 1.0, None, None)


# -- stand-ins: the ops, the engine, a GPU tensor of whole bytes -----------------------------

def _gpu_tensor(nbytes: int) -> StandInGpuTensor:
    """A GPU tensor stand-in of ``nbytes`` bytes."""
    return StandInGpuTensor(np.zeros(nbytes, np.uint8))


class _Engine(BatchingEngine):
    """Records each ``together`` batch (the names started inside it) and the error
    markers a refused submission sends the peers."""

    dead = None

    def __init__(self) -> None:
        super().__init__()
        self.markers: list[tuple[str, str]] = []     # (name, error) told to the peers

    def submit(self, request: Any) -> int:
        assert request.desc.error, "only error markers reach the stand-in engine"
        self.markers.append((request.desc.name, request.desc.error))
        return -1



class _Job:
    """A reducer's world: what was started (name, batched?, scaling), what synchronized."""

    def __init__(self) -> None:
        self.engine = _Engine()
        self.started: list[tuple[str, bool, dict]] = []
        self.synchronized: list[int] = []
        self.refuse: set[str] = set()      # names whose submission raises

    def allreduce_async_(self, wire: Any, name: str, **scaling: Any) -> int:
        if name in self.refuse:
            raise UsageError(f"{name} refused")
        self.started.append((name, self.engine.current is not None, scaling))
        if self.engine.current is not None:
            self.engine.current.append(name)
        return len(self.started) - 1       # handles count from 0, as the engine's do

    def names(self) -> list[str]:
        return [name for name, _, _ in self.started]

    def reducer(self, keys: str = "abcde", groups: object = None, passes: int = 1,
                predivide: float = 1.0, process_set: Optional[hvd.ProcessSet] = None,
                compression: Any = Compression.none) -> GradientReducer:
        ops = {"allreduce_async_": self.allreduce_async_,
               "synchronize": self.synchronized.append}
        return GradientReducer(ops, {k: k for k in keys}, compression, passes, hvd.Average,
                               predivide, process_set, plan_groups(list(keys), groups))


BUCKET_BYTES = 10


@pytest.fixture
def job(monkeypatch: pytest.MonkeyPatch) -> _Job:
    """Two ranks, HVDLITE_BUCKET_BYTES=10, the stand-in GPU adapter registered."""
    made = _Job()
    monkeypatch.setattr(adapters, "_REGISTERED", [StandInGpuAdapter()] + adapters._REGISTERED)
    monkeypatch.setattr(runtime, "size", lambda: 2)
    monkeypatch.setattr(runtime, "rank", lambda: 0)
    monkeypatch.setattr(runtime, "engine", lambda what="": made.engine)
    monkeypatch.setattr(runtime.RUNTIME, "engine", made.engine)
    monkeypatch.setattr(runtime.RUNTIME, "topology", SimpleNamespace(size=2))
    monkeypatch.setattr(runtime, "config",
                        lambda: Config.load({}, bucket_bytes=BUCKET_BYTES))
    return made


def _backward(reducer: GradientReducer, keys: str) -> None:
    """What a binding's gradient hook does: count the pass, submit what is due."""
    for key in keys:
        for due in reducer.ready(key):
            reducer.submit(due, np.ones(2, np.float32))


# -- a set of one rank ---------------------------------------------------------------------

def test_on_one_rank_nothing_is_sent_without_a_predivide_factor(job: _Job,
                                                                 monkeypatch: Any) -> None:
    monkeypatch.setattr(runtime, "size", lambda: 1)
    for process_set in (None, hvd.ProcessSet([0])):   # the one-rank world, a one-rank set
        reducer = job.reducer(process_set=process_set, compression=Compression.fp16)
        grad = np.arange(3, dtype=np.float32)
        reducer.submit("a", grad)
        stored: list = []
        reducer.wait_all(lambda g, restored: stored.append(restored))
        assert job.started == [] and job.synchronized == [] and stored == []
        assert reducer.pending == {}


def test_on_one_rank_the_report_still_learns_the_gradients(job: _Job,
                                                           monkeypatch: Any) -> None:
    """HVDLITE_REPORT's recorder hears of each gradient not reduced (the scaling
    forecast of a one-rank run needs their bytes); without a report nothing is told."""
    monkeypatch.setattr(runtime, "size", lambda: 1)
    told: list[int] = []
    monkeypatch.setattr(runtime.RUNTIME, "recorder", SimpleNamespace(unreduced=told.append))
    reducer = job.reducer()
    reducer.submit("a", np.zeros(3, np.float32))
    reducer.submit("b", np.zeros(5, np.float64))
    assert told == [12, 40] and job.started == []
    monkeypatch.setattr(runtime.RUNTIME, "recorder", None)
    reducer.submit("c", np.zeros(3, np.float32))
    assert told == [12, 40]


@pytest.mark.parametrize("factor", [0.5, 3.0])
def test_on_one_rank_a_predivide_factor_is_still_applied(job: _Job, factor: float) -> None:
    reducer = job.reducer(predivide=factor, process_set=hvd.ProcessSet([0]))
    reducer.submit("a", np.ones(3, np.float32))
    (name, _, scaling), = job.started
    assert name == "allreduce.a"
    assert (int(scaling["op"]), scaling["prescale_factor"], scaling["postscale_factor"]) == (
        int(hvd.Sum), 1.0 / factor, factor / 1)
    reducer.wait_all(lambda g, restored: None)
    assert job.synchronized == [0]


# -- when a key is due ---------------------------------------------------------------------

def test_a_second_backward_before_step_is_refused_though_a_group_was_incomplete(
        job: _Job) -> None:
    reducer = job.reducer(keys="ab", groups=[["a", "b"]])
    _backward(reducer, "a")                # b has no gradient this pass: the group waits
    assert job.started == []
    with pytest.raises(HvdliteError, match="'a' was computed more than "
                                           "backward_passes_per_step=1 times"):
        _backward(reducer, "ab")           # a second backward() without step()
    assert job.started == []               # the group was not released without b's gradient


def test_with_several_passes_a_group_member_counted_in_full_is_refused_again(
        job: _Job) -> None:
    reducer = job.reducer(keys="ab", groups=[["a", "b"]], passes=2)
    _backward(reducer, "a")
    _backward(reducer, "a")                # a's two passes: the group waits for b
    with pytest.raises(HvdliteError, match="'a' was computed more than "
                                           "backward_passes_per_step=2 times"):
        _backward(reducer, "a")
    assert job.started == []


def test_a_group_of_hundreds_of_parameters_is_due_when_the_last_is_ready() -> None:
    keys = [f"p{i}" for i in range(300)]    # counts past the small integers CPython shares
    ops = {"allreduce_async_": None, "synchronize": None}
    reducer = GradientReducer(ops, {k: k for k in keys}, Compression.none, 1, hvd.Average,
                              1.0, None, plan_groups(keys, 1))
    assert all(reducer.ready(k) == [] for k in keys[:-1])
    assert reducer.ready(keys[-1]) == keys


# -- GPU buckets and CPU gradients ---------------------------------------------------------

def test_a_gpu_bucket_leaves_exactly_when_it_reaches_its_byte_count(job: _Job) -> None:
    reducer = job.reducer(keys="abcdefghijk")
    for step in range(2):
        # Bytes count from zero in each bucket and each step: 9 of 10 wait, the 10th sends.
        for key, nbytes, flushed in (("a", 4, []), ("b", 5, []), ("c", 1, ["a", "b", "c"]),
                                     ("d", 9, []), ("e", 1, ["d", "e"]), ("f", 3, [])):
            job.engine.batches.clear()
            reducer.submit(key, _gpu_tensor(nbytes))
            expected = [[f"allreduce.{k}" for k in flushed]] if flushed else []
            assert job.engine.batches == expected, (step, key)
        job.engine.batches.clear()
        reducer.wait_all(lambda g, restored: None)     # the partial bucket goes at synchronize
        assert job.engine.batches == [["allreduce.f"]] and reducer.pending == {}
    assert len(job.synchronized) == 12


def test_cpu_gradients_start_at_submit_outside_any_bucket(job: _Job) -> None:
    reducer = job.reducer()
    for key, grad in (("a", np.ones(4, np.float32)), ("b", np.ones(0, np.float32)),
                      ("c", np.ones(100, np.float64))):   # 0 bytes, then beyond a bucket
        reducer.submit(key, grad)
        assert job.names()[-1] == f"allreduce.{key}"
    assert job.engine.batches == [] and not any(batched for _, batched, _ in job.started)
    reducer.wait_all(lambda g, restored: None)
    assert job.engine.batches == [] and job.synchronized == [0, 1, 2]


class _HostTensor:
    def __init__(self, device_type: str) -> None:
        self.array = np.ones(4, np.float32)
        self.device_type = device_type


class _ReadsItsDeviceAdapter(StandInGpuAdapter):
    """An adapter that reports the device name its framework gives it, as a string built
    at run time (equal to "cpu", not the same object as the literal)."""

    def is_tensor(self, obj: Any) -> bool:
        return isinstance(obj, _HostTensor)

    def device(self, tensor: Any) -> str:
        return tensor.device_type


def test_a_device_reported_as_cpu_is_compared_by_value(job: _Job, monkeypatch: Any) -> None:
    monkeypatch.setattr(adapters, "_REGISTERED", [_ReadsItsDeviceAdapter()] + adapters._REGISTERED)
    name, literal = "".join(["c", "p", "u"]), "cpu"
    assert name == literal and name is not literal      # equal, not the same object
    reducer = job.reducer()
    reducer.submit("a", _HostTensor(name))
    assert job.names() == ["allreduce.a"] and job.engine.batches == []


def test_a_refused_cpu_gradient_raises_at_submit_and_is_not_left_pending(job: _Job) -> None:
    job.refuse.add("allreduce.b")
    reducer = job.reducer()
    reducer.submit("a", np.ones(4, np.float32))
    with pytest.raises(UsageError, match="allreduce.b refused"):
        reducer.submit("b", np.ones(4, np.float32))
    assert list(reducer.pending) == ["a"]    # zero_grad() and the next backward see only a


def test_a_refused_bucket_fails_synchronize_without_taking_other_ops_handles(
        job: _Job) -> None:
    from hvdlite.core.handles import HandleTable
    table = HandleTable()                    # the engine's: handles count from 0
    mine = [table.create(), table.create()]  # two async ops of the script's own, not waited yet
    for handle in mine:
        table.complete(handle, f"result {handle}")

    def allreduce_async_(wire: Any, name: str, **_: Any) -> int:
        if name == "allreduce.a":
            raise UsageError("allreduce.a refused")
        handle = table.create()
        table.complete(handle, None)
        return handle

    reducer = GradientReducer({"allreduce_async_": allreduce_async_, "synchronize": table.wait},
                              {"a": "a", "b": "b"}, Compression.none, 1, hvd.Average, 1.0,
                              None, ({}, []))
    reducer.submit("a", _gpu_tensor(4))
    with pytest.raises(UsageError, match="allreduce.a refused"):
        reducer.submit("b", _gpu_tensor(BUCKET_BYTES))     # fills the bucket: a is refused
    # Neither was started: neither is pending (as for a refused CPU gradient), and the
    # peers are told that b failed here rather than waiting for it.
    assert reducer.pending == {}
    assert job.engine.markers == [("allreduce.b", "allreduce.a refused")]
    reducer.wait_all(lambda g, restored: None)
    assert [table.wait(h) for h in mine] == ["result 0", "result 1"]


def test_a_refusal_inside_a_bucket_keeps_the_gradients_started_before_it(job: _Job) -> None:
    reducer = job.reducer()
    job.refuse.add("allreduce.b")
    reducer.submit("a", _gpu_tensor(3))
    reducer.submit("b", _gpu_tensor(3))
    with pytest.raises(UsageError, match="allreduce.b refused"):
        reducer.submit("c", _gpu_tensor(4))        # 10 bytes: the bucket goes, b is refused
    assert job.names() == ["allreduce.a"] and list(reducer.pending) == ["a"]
    assert job.engine.markers == [("allreduce.c", "allreduce.b refused")]
    job.refuse.clear()
    reducer.wait_all(lambda g, restored: None)    # a is waited for; nothing else is
    assert job.synchronized == [0] and reducer.pending == {}


# -- a reduction that fails ------------------------------------------------------------------

def test_a_failed_reduction_leaves_nothing_pending_and_the_others_are_waited_for(
        job: _Job) -> None:
    reducer = job.reducer(keys="abc", compression=Compression.fp16)
    for key in "abc":
        reducer.submit(key, np.ones(2, np.float32))
    failing = {1: hvd.MismatchError("b: dtype differs"), 2: HvdliteError("c: peer lost")}

    def synchronize(handle: int) -> None:
        job.synchronized.append(handle)
        if handle in failing:
            raise failing[handle]
    reducer._synchronize = synchronize
    stored: list = []
    with pytest.raises(hvd.MismatchError, match="b: dtype differs"):   # the first error
        reducer.wait_all(lambda grad, restored: stored.append(restored))
    assert job.synchronized == [0, 1, 2]         # c was still waited for
    assert len(stored) == 1                      # a's result was written back
    assert reducer.pending == {}
    reducer.submit("a", np.ones(2, np.float32))  # the next backward starts clean
    assert reducer.pending.keys() == {"a"}


def test_a_refusal_when_synchronize_flushes_the_bucket_still_waits_for_the_started(
        job: _Job) -> None:
    reducer = job.reducer()
    reducer.submit("a", np.ones(2, np.float32))    # a CPU gradient: started at once
    job.refuse.add("allreduce.b")
    reducer.submit("b", _gpu_tensor(3))            # waits in the bucket until synchronize
    with pytest.raises(UsageError, match="allreduce.b refused"):
        reducer.wait_all(lambda grad, restored: None)
    assert job.synchronized == [0] and reducer.pending == {}


def test_an_error_writing_a_result_back_leaves_nothing_pending(job: _Job) -> None:
    reducer = job.reducer(keys="ab", compression=Compression.fp16)
    for key in "ab":
        reducer.submit(key, np.ones(2, np.float32))

    def store(grad: Any, restored: Any) -> None:
        raise RuntimeError("the gradient's storage was freed")
    with pytest.raises(RuntimeError, match="storage was freed"):
        reducer.wait_all(store)
    assert reducer.pending == {}


def test_buckets_cut_at_the_cap_the_first_one_small_and_by_kind() -> None:
    from hvdlite.api.gradients import bucket_plan
    mib = 1 << 20
    sizes = [mib // 2, mib // 2, mib // 2, 10 * mib, 10 * mib, 10 * mib, mib]
    kinds = ["f32"] * len(sizes)
    # The first bucket closes past 1 MiB; the others past the cap (25 MiB); in order.
    assert bucket_plan(sizes, kinds, range(len(sizes)), 25 * mib) == [
        [0, 1], [2, 3, 4], [5, 6]]
    assert bucket_plan(sizes, kinds, [6, 5, 4, 3, 2, 1, 0], 25 * mib) == [
        [6], [5, 4], [3, 2, 1, 0]]
    # Each kind (dtype, device) has buckets of its own, each with its small first one.
    mixed = ["f32", "f64"] * 3
    assert bucket_plan([mib] * 6, mixed, range(6), 25 * mib) == [[0], [1], [2, 4], [3, 5]]
    # No cap: one bucket per kind; a cap below the first bucket's size bounds it too.
    assert bucket_plan(sizes, kinds, range(len(sizes)), 0) == [list(range(len(sizes)))]
    assert bucket_plan([300, 300, 300], ["x"] * 3, range(3), 500) == [[0], [1], [2]]
