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
from hvdlite.core import devices
from hvdlite.core.executor import Executor
from hvdlite.core.requests import Descriptor, Kind, ReduceOp, Request, Response
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
        return device.startswith("fake")

    def reduction_dtype(self, dtype: np.dtype) -> np.dtype:
        return np.dtype(dtype)

    def open_set(self, set_id: int, comm: Any) -> None:
        pass

    def close_set(self, set_id: int) -> None:
        pass

    def allreduce(self, set_id: int, buf: np.ndarray, op: ReduceOp) -> _StreamWork:
        buf *= 2
        self.works.append(_StreamWork())
        return self.works[-1]

    many = False        # whether allreduce_many serves (a set staged through the host: no)
    averages = True
    many_calls: list[list[tuple[np.ndarray, np.ndarray]]] = []

    def allreduce_many(self, set_id: int, pairs: list, op: ReduceOp) -> Any:
        if not self.many:
            return None
        _StreamBackend.many_calls.append(pairs)
        for source, target in pairs:     # two ranks with the same values
            target[...] = source if op is ReduceOp.AVERAGE else 2 * source
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
    run.open_set(0, RecordingComm(2))
    run.chain._refresh()
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


def test_host_work_that_is_not_done_still_completes_only_when_done(executor: Any) -> None:
    """Without ``ordered`` (an asynchronous host backend), the handle waits."""
    run, completed, _ = executor
    _StreamWork.ordered = False
    try:
        request = _allreduce("h", np.ones(2))
        run.run(0, [Response(request.desc)], {"h": request})
        assert completed == [] and run.busy
        _StreamBackend.made[0].works[0].finished = True
        assert run.progress() == 1 and len(completed) == 1
    finally:
        _StreamWork.ordered = True


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


@pytest.mark.parametrize("case", ["prescale", "joined", "staged"])
def test_groups_the_backend_cannot_take_whole_are_fused(many: Any, case: str) -> None:
    run, completed, _ = many
    request = _allreduce("p", np.full(3, 2.0), ReduceOp.SUM)
    response = Response(request.desc)
    if case == "prescale":
        request.desc = request.desc._replace(prescale=0.5)
        response = Response(request.desc)
    elif case == "joined":
        response = Response(request.desc, joined=(1,))
    else:
        _StreamBackend.many = False
    run.run(0, [response], {"p": request})
    assert _StreamBackend.many_calls == []
    expected = 2.0 if case == "prescale" else 4.0
    assert completed[0][1].value.tolist() == [expected] * 3
