"""The executor with work queued on a device stream, without a GPU: a fake device
whose namespace is NumPy and a backend whose work is "ordered" and finishes only
when the test says so. Its handles must complete at once, fenced, the fusion
buffer must be reused without waiting, and the inputs must stay referenced until
the stream is past them (the framework must not reuse their memory before)."""
from __future__ import annotations

import gc
import weakref
from typing import Any, Iterator

import numpy as np
import pytest

from hvdlite.config import Config
from hvdlite.engine import devices
from hvdlite.engine.executor import Executor
from hvdlite.negotiation.requests import Descriptor, Kind, ReduceOp, Request, Response
from hvdlite.transport.mpi_transport import MpiTransport
from tests.unit.fake_comm import RecordingComm


class _StreamWork:
    ordered = True

    def __init__(self) -> None:
        self.finished = False
        self.waited = 0

    def done(self) -> bool:
        return self.finished

    def wait(self) -> None:
        self.waited += 1
        self.finished = True


class _StreamBackend:
    """Sums as if two ranks held the same values; the work stays "on the stream"."""
    name = "fake-stream"
    made: list["_StreamBackend"] = []

    def __init__(self, config: Any) -> None:
        self.works: list[_StreamWork] = []
        _StreamBackend.made.append(self)

    def supports(self, kind: str, dtype: np.dtype, device: str, nbytes: int,
                 op: ReduceOp = ReduceOp.SUM) -> bool:
        return device.startswith(("fake", "apu"))

    def reduction_dtype(self, dtype: np.dtype) -> np.dtype:
        return np.dtype(dtype)

    def open_set(self, set_id: int, transport: Any) -> None:
        pass

    def close_set(self, set_id: int) -> None:
        pass

    def allreduce(self, set_id: int, buf: np.ndarray, op: ReduceOp) -> _StreamWork:
        buf *= 2
        self.works.append(_StreamWork())
        return self.works[-1]

    many = False        # whether allreduce_many serves (a set staged through the host: no)
    many_calls: list[list[tuple[np.ndarray, np.ndarray]]] = []

    def allreduce_many(self, set_id: int, pairs: list, op: ReduceOp) -> Any:
        if not self.many:
            return None
        _StreamBackend.many_calls.append(pairs)
        for source, target in pairs:     # two ranks with the same values, summed
            target[...] = 2 * source
        self.works.append(_StreamWork())
        return self.works[-1]

    def broadcast(self, set_id: int, buf: np.ndarray, root: int) -> _StreamWork:
        self.works.append(_StreamWork())
        return self.works[-1]


@pytest.fixture
def executor(device_registry: None) -> Iterator[tuple[Executor, list, list]]:
    prepared: list[list[Any]] = []
    fences: list[str] = []

    def fence(device: str) -> str:
        fences.append(f"fence{len(fences)}")
        return fences[-1]

    devices.register_device("fake", devices.DeviceType(
        np, lambda device, ready: prepared.append(list(ready)), fence))
    devices.register_backend(_StreamBackend)
    _StreamBackend.made.clear()
    completed: list[tuple[Request, Any]] = []
    run = Executor(Config.load({}), lambda request, result: completed.append((request, result)),
                   lambda: None)
    run.open_set(0, MpiTransport(RecordingComm(2)))
    run.chain.configure(run.config)    # registered after the chain was built
    yield run, completed, prepared


def _allreduce(name: str, values: np.ndarray, op: ReduceOp = ReduceOp.AVERAGE) -> Request:
    desc = Descriptor(name, Kind.ALLREDUCE, dtype=values.dtype.name, shape=values.shape,
                      op=int(op), device="fake:0")
    request = Request(desc, 0, values, np.empty_like(values))
    request.ready = f"ready-{name}"
    return request


def test_ordered_work_completes_at_once_fenced_and_keeps_its_inputs(executor: Any) -> None:
    run, completed, prepared = executor
    requests = [_allreduce("a", np.arange(4.0)), _allreduce("b", np.full(3, 5.0))]
    watched = weakref.ref(requests[0].array)
    run.run(0, [Response(r.desc) for r in requests], {r.desc.name: r for r in requests})
    backend = _StreamBackend.made[0]
    assert len(backend.works) == 1 and not backend.works[0].done()   # one fused reduction
    assert not run.busy                              # nothing for the engine to poll
    assert [r.desc.name for r, _ in completed] == ["a", "b"]
    assert all(isinstance(result, devices.Fenced) for _, result in completed)
    assert completed[0][1].value.tolist() == [0.0, 1.0, 2.0, 3.0]   # sum of 2 ranks / 2
    assert completed[0][1].fence is completed[1][1].fence          # one fence per group
    assert prepared == [["ready-a", "ready-b"]]      # the stream waited on both inputs
    requests.clear()
    completed.clear()
    gc.collect()
    assert watched() is not None                     # still referenced: the stream reads it
    backend.works[0].finished = True
    run.progress()
    gc.collect()
    assert watched() is None


def test_the_next_run_lets_go_of_inputs_whose_ordered_work_is_done(executor: Any) -> None:
    """Retiring happens at each run as well as at each progress: a steady stream of
    submissions does not keep every finished step's inputs alive."""
    run, completed, _ = executor
    first = _allreduce("a", np.arange(4.0))
    watched = weakref.ref(first.array)
    run.run(0, [Response(first.desc)], {"a": first})
    del first
    completed.clear()
    _StreamBackend.made[0].works[0].finished = True
    second = _allreduce("b", np.full(3, 5.0))
    run.run(0, [Response(second.desc)], {"b": second})
    gc.collect()
    assert watched() is None


def test_the_fusion_buffer_is_reused_without_waiting_for_ordered_work(executor: Any) -> None:
    run, completed, _ = executor
    for step in range(3):
        requests = [_allreduce(f"g{i}", np.full(5, float(step + i)), ReduceOp.SUM)
                    for i in range(2)]
        run.run(0, [Response(r.desc) for r in requests], {r.desc.name: r for r in requests})
    works = _StreamBackend.made[0].works
    assert len(works) == 3 and not any(w.waited for w in works)
    assert [r.value.tolist() for _, r in completed[-2:]] == [[4.0] * 5, [6.0] * 5]


def test_drain_waits_for_the_stream(executor: Any) -> None:
    run, _, _ = executor
    request = _allreduce("d", np.ones(2))
    run.run(0, [Response(request.desc)], {"d": request})
    run.drain()
    assert _StreamBackend.made[0].works[0].waited == 1


@pytest.fixture(params=["false", "absent"])
def unordered(request: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Work that is not on a stream: ``ordered`` False, or no such attribute."""
    if request.param == "false":
        monkeypatch.setattr(_StreamWork, "ordered", False)
    else:
        monkeypatch.delattr(_StreamWork, "ordered")


def test_host_work_that_is_not_done_still_completes_only_when_done(executor: Any,
                                                                   unordered: None) -> None:
    """Without ``ordered`` (an asynchronous host backend), the handle waits."""
    run, completed, _ = executor
    request = _allreduce("h", np.ones(2))
    run.run(0, [Response(request.desc)], {"h": request})
    assert completed == [] and run.busy
    _StreamBackend.made[0].works[0].finished = True
    assert run.progress() == 1 and len(completed) == 1


def test_unordered_work_finishes_in_order(executor: Any, unordered: None) -> None:
    """A later work done first completes nothing: handles complete in agreed order."""
    run, completed, _ = executor
    for name in ("first", "second"):
        request = _allreduce(name, np.ones(3))
        run.run(0, [Response(request.desc)], {name: request})
    works = _StreamBackend.made[0].works
    works[1].finished = True
    assert run.progress() == 0 and completed == [] and run.busy
    works[0].finished = True
    assert run.progress() == 2 and [r.desc.name for r, _ in completed] == ["first", "second"]
    assert not run.busy


def test_unordered_work_is_waited_for_before_its_fusion_buffer_is_reused(
        executor: Any, unordered: None) -> None:
    run, completed, _ = executor
    for step in range(2):
        requests = [_allreduce(f"u{i}", np.full(2, float(step)), ReduceOp.SUM) for i in range(2)]
        run.run(0, [Response(r.desc) for r in requests], {r.desc.name: r for r in requests})
    works = _StreamBackend.made[0].works
    assert [w.waited for w in works] == [1, 0]
    assert run.progress() == 1 and len(completed) == 2     # the first group, waited for
    run.drain()
    assert [r.value.tolist() for _, r in completed[2:]] == [[2.0, 2.0]] * 2


def test_inputs_are_released_in_order_once_the_stream_is_past_them(executor: Any) -> None:
    """A later work done first releases nothing: the stream runs in order, and the
    earlier work's inputs are still being read."""
    run, completed, _ = executor
    watched = []
    for name in ("first", "second"):
        request = _allreduce(name, np.ones(3))
        watched.append(weakref.ref(request.array))
        run.run(0, [Response(request.desc)], {name: request})
        del request
    completed.clear()                   # what the caller got back (the handles) is gone
    works = _StreamBackend.made[0].works
    works[1].finished = True
    run.progress()
    gc.collect()
    assert [w() is not None for w in watched] == [True, True]
    works[0].finished = True
    run.progress()
    gc.collect()
    assert [w() is not None for w in watched] == [False, False]


def test_a_collective_other_than_allreduce_waits_for_its_input_on_the_stream(
        executor: Any) -> None:
    run, completed, prepared = executor
    values = np.arange(3.0)
    desc = Descriptor("b", Kind.BROADCAST, dtype="float64", shape=(3,), root=1,
                      device="fake:0")
    request = Request(desc, 0, values, values.copy())
    request.ready = "ready-b"
    run.run(0, [Response(desc)], {"b": request})
    assert prepared == [["ready-b"]]
    assert [(r.desc.name, type(x)) for r, x in completed] == [("b", devices.Fenced)]


class _Placed:
    """Stands in for a TensorFlow tensor placed by TensorFlow's device string."""

    def __init__(self, device: str, dtype: str = "float32") -> None:
        import tensorflow as tf
        self.device, self.dtype = device, tf.as_dtype(dtype)


@pytest.mark.parametrize("placement,expected", [
    ("/job:localhost/replica:0/task:0/device:GPU:1", "cuda:1"),
    ("/job:worker/replica:0/task:3/device:GPU:0", "cuda:0"),
    ("/job:localhost/replica:0/task:0/device:CPU:0", "cpu"),
    ("", "cpu")])
def test_tensorflow_placement_names_the_device(placement: str, expected: str) -> None:
    adapter = pytest.importorskip("hvdlite.tensorflow.adapter",
                                  reason="TensorFlow is not installed here").TENSORFLOW
    assert adapter.device(_Placed(placement)) == expected
    assert adapter.device(_Placed(placement, "int32")) == "cpu"     # kept in host memory


def test_tensorflow_in_place_ops_write_only_variables() -> None:
    tf = pytest.importorskip("tensorflow", reason="TensorFlow is not installed here")
    from hvdlite.tensorflow.adapter import TENSORFLOW
    assert TENSORFLOW.writable(tf.Variable([1.0]))
    assert not TENSORFLOW.writable(tf.constant([1.0]))


@pytest.fixture
def many(executor: Any) -> Iterator[Any]:
    _StreamBackend.many = True
    _StreamBackend.many_calls.clear()
    yield executor
    _StreamBackend.many = False


def test_a_backend_that_reduces_many_buffers_gets_each_tensor_in_place(many: Any) -> None:
    run, completed, _ = many
    requests = [_allreduce("a", np.arange(3.0)), _allreduce("b", np.full(2, 4.0))]
    run.run(0, [Response(r.desc) for r in requests], {r.desc.name: r for r in requests})
    (pairs,) = _StreamBackend.many_calls           # one call, no fusion buffer
    assert [(s is r.array, t is r.output) for (s, t), r in zip(pairs, requests)] == \
        [(True, True)] * 2
    assert [r.value.tolist() for _, r in completed] == [[0.0, 1.0, 2.0], [4.0, 4.0]]


@pytest.mark.parametrize("case", ["prescale", "prescale up", "joined", "staged", "widened"])
def test_groups_the_backend_cannot_take_whole_are_fused(many: Any, case: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    run, completed, _ = many
    dtype = np.float16 if case == "widened" else np.float64
    request = _allreduce("p", np.full(3, 2.0, dtype), ReduceOp.SUM)
    response = Response(request.desc)
    if case.startswith("prescale"):
        request.desc = request.desc._replace(prescale=0.5 if case == "prescale" else 2.0)
        response = Response(request.desc)
    elif case == "joined":
        response = Response(request.desc, joined=(1,))
    elif case == "widened":       # a backend that reduces half types in float32
        monkeypatch.setattr(_StreamBackend, "reduction_dtype",
                            lambda self, dt: np.dtype(np.float32) if dt == np.float16 else dt)
    else:
        _StreamBackend.many = False
    run.run(0, [response], {"p": request})
    assert _StreamBackend.many_calls == []
    expected = {"prescale": 2.0, "prescale up": 8.0}.get(case, 4.0)
    assert completed[0][1].value.tolist() == [expected] * 3
    assert completed[0][1].value.dtype == dtype


def test_a_backend_that_reduces_many_is_divided_after_for_average(many: Any) -> None:
    """A backend's many-buffer call sums; Average is the executor's division after
    it (never a library's own average: see hvdlite/backends/nccl.py)."""
    run, completed, _ = many
    request = _allreduce("v", np.full(3, 3.0), ReduceOp.AVERAGE)
    request.desc = request.desc._replace(postscale=2.0)
    run.run(0, [Response(request.desc)], {"v": request})
    assert len(_StreamBackend.many_calls) == 1
    assert completed[0][1].value.tolist() == [6.0] * 3


def test_a_device_named_before_cpu_is_still_a_device(executor: Any) -> None:
    """Whether a tensor is on the host is ``device == "cpu"``, not an order of names:
    a device type sorting before "cpu" is prepared, reduced by its backend's many-
    buffer call, and fenced."""
    run, completed, prepared = executor
    fences: list[str] = []
    devices.register_device("apu", devices.DeviceType(
        np, lambda device, ready: prepared.append(list(ready)),
        lambda device: fences.append(device) or f"fence{len(fences)}"))
    _StreamBackend.many = True
    _StreamBackend.many_calls.clear()
    try:
        requests = [_allreduce(n, np.full(2, 3.0), ReduceOp.SUM) for n in "ab"]
        for request in requests:
            request.desc = request.desc._replace(device="apu:0")
        values = np.arange(2.0)
        bcast = Request(Descriptor("c", Kind.BROADCAST, dtype="float64", shape=(2,), root=0,
                                   device="apu:0"), 0, values, values.copy())
        bcast.ready = "ready-c"
        run.run(0, [Response(r.desc) for r in requests + [bcast]],
                {r.desc.name: r for r in requests + [bcast]})
    finally:
        _StreamBackend.many = False
    assert len(_StreamBackend.many_calls) == 1
    assert prepared == [["ready-a", "ready-b"], ["ready-c"]]
    assert fences == ["apu:0", "apu:0"]
    assert [(r.desc.name, x.fence, x.value.tolist()) for r, x in completed] == [
        ("a", "fence1", [6.0, 6.0]), ("b", "fence1", [6.0, 6.0]), ("c", "fence2", [0.0, 1.0])]
