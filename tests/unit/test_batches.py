"""Submissions in batches, without MPI: a thread's batch reaches the engine's queue
all at once with one wake-up, and its GPU tensors share one ready event (a fake
GPU tensor stands in for CUDA; the gradient buckets on a device are in
test_reducer.py)."""
from __future__ import annotations

import collections
import threading
from typing import Any

import numpy as np
import pytest

from hvdlite.api import runtime
from hvdlite.failure import waiting
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
    queued: list[bool] = []
    with batches.batch():
        batches.put("held")
        other = threading.Thread(target=lambda: queued.append(batches.put("other thread")))
        other.start()
        other.join()
        assert list(queue) == ["other thread"]
        assert queued == [True]                    # queued at once: its caller rings
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


class _CountingGpuAdapter(StandInGpuAdapter):
    def __init__(self) -> None:
        self.events = 0

    def ready_event(self, tensor: Any) -> int:
        self.events += 1
        return self.events


def test_a_batch_of_gpu_tensors_shares_one_ready_event(monkeypatch: pytest.MonkeyPatch) -> None:
    from hvdlite.api import submission
    adapter = _CountingGpuAdapter()
    monkeypatch.setattr(runtime, "engine", lambda what="": BatchingEngine())
    alone = [submission.Input(adapter, _gpu_tensor(4), "t").ready for _ in range(2)]
    with submission.together("test"):
        shared = [submission.Input(adapter, _gpu_tensor(4), "t").ready for _ in range(3)]
    assert alone == [1, 2] and shared == [3, 3, 3]
