"""Submissions in batches, without MPI: a thread's batch reaches the engine's queue
all at once with one wake-up, and DistributedOptimizer's GPU gradients travel in
buckets of HVDLITE_BUCKET_BYTES (a fake GPU tensor stands in for CUDA)."""
from __future__ import annotations

import collections
import threading
from typing import Any, Iterator

import numpy as np
import pytest

from hvdlite.api import adapter as adapters
from hvdlite.api import runtime
from hvdlite.api.compression import Compression
from hvdlite.api.gradients import GradientReducer
from hvdlite.config import Config
from hvdlite.core import waiting
from tests.unit.stand_ins import BatchingEngine, StandInGpuAdapter, StandInGpuTensor


class _Bell:
    def __init__(self) -> None:
        self.rings = 0

    def ring(self) -> None:
        self.rings += 1


def test_a_batch_is_queued_whole_when_it_ends_with_one_ring() -> None:
    queue: collections.deque = collections.deque()
    bell = _Bell()
    batches = waiting.Batches(queue, bell)  # type: ignore[arg-type]
    assert batches.put("alone") and list(queue) == ["alone"]
    with batches.batch():
        assert not batches.put("a") and not batches.put("b")
        with batches.batch():                      # nested: the outer batch queues
            assert not batches.put("c")
        assert list(queue) == ["alone"]            # nothing reached the engine yet
    assert list(queue) == ["alone", "a", "b", "c"] and bell.rings == 1


def test_a_batch_holds_only_its_own_threads_submissions() -> None:
    queue: collections.deque = collections.deque()
    batches = waiting.Batches(queue, _Bell())  # type: ignore[arg-type]
    with batches.batch():
        batches.put("held")
        other = threading.Thread(target=lambda: batches.put("other thread"))
        other.start()
        other.join()
        assert list(queue) == ["other thread"]
    assert list(queue) == ["other thread", "held"]


def test_a_batch_left_by_an_exception_still_queues_what_it_holds() -> None:
    queue: collections.deque = collections.deque()
    batches = waiting.Batches(queue, _Bell())  # type: ignore[arg-type]
    with pytest.raises(RuntimeError), batches.batch():
        batches.put("submitted before the error")
        raise RuntimeError("a refused tensor")
    assert list(queue) == ["submitted before the error"]


def _gpu_tensor(count: int) -> StandInGpuTensor:
    return StandInGpuTensor(np.zeros(count, np.float32))


_Engine = BatchingEngine


@pytest.fixture
def reducer(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[GradientReducer, _Engine, list]]:
    engine = _Engine()
    started: list[str] = []
    synchronized: list[int] = []
    monkeypatch.setattr(adapters, "_REGISTERED", [StandInGpuAdapter()] + adapters._REGISTERED)
    monkeypatch.setattr(runtime, "size", lambda: 2)
    monkeypatch.setattr(runtime, "rank", lambda: 0)
    monkeypatch.setattr(runtime, "engine", lambda what="": engine)
    monkeypatch.setattr(runtime, "config", lambda: Config.load({}, bucket_bytes=3 * 400))

    def allreduce_async_(wire: Any, name: str, **_: Any) -> int:
        started.append(name)
        if engine.current is not None:
            engine.current.append(name)
        return len(started)

    ops = {"allreduce_async_": allreduce_async_, "synchronize": synchronized.append}
    names = {k: f"p{k}" for k in range(5)}
    made = GradientReducer(ops, names, Compression.none, 1, 1, 1.0, None, ({}, []))
    yield made, engine, synchronized


def test_gpu_gradients_go_in_buckets_and_the_rest_at_synchronize(reducer: Any) -> None:
    made, engine, synchronized = reducer
    for key in range(5):                       # 100 float32 each: 400 bytes, 3 per bucket
        made.submit(key, _gpu_tensor(100))
        if key < 2:
            assert engine.batches == []        # still in the bucket
    assert engine.batches == [["allreduce.p0", "allreduce.p1", "allreduce.p2"]]
    assert set(made.pending) == set(range(5))  # in the bucket counts as pending
    made.wait_all(lambda grad, restored: None)
    assert engine.batches[1] == ["allreduce.p3", "allreduce.p4"]
    assert synchronized == [1, 2, 3, 4, 5] and made.pending == {}


def test_a_gradient_in_the_bucket_computed_again_is_refused(reducer: Any) -> None:
    made, _, _ = reducer
    assert made.ready(0) == [0]
    made.submit(0, _gpu_tensor(10))
    with pytest.raises(Exception, match="more than backward_passes_per_step"):
        made.ready(0)


class _CountingGpuAdapter(StandInGpuAdapter):
    def __init__(self) -> None:
        self.events = 0

    def ready_event(self, tensor: Any) -> int:
        self.events += 1
        return self.events


def test_a_batch_of_gpu_tensors_shares_one_ready_event(monkeypatch: pytest.MonkeyPatch) -> None:
    from hvdlite.api import submission
    adapter = _CountingGpuAdapter()
    monkeypatch.setattr(runtime, "engine", lambda what="": _Engine())
    alone = [submission.Input(adapter, _gpu_tensor(4), "t").ready for _ in range(2)]
    with submission.together("test"):
        shared = [submission.Input(adapter, _gpu_tensor(4), "t").ready for _ in range(3)]
    assert alone == [1, 2] and shared == [3, 3, 3]
