"""HVDLITE_REPORT's recorder with a fake clock: the per-step means of its window,
when it samples the GPU, and the peer-wait clock from an arbitrary origin.
(tests/unit/test_report.py covers the window's set-up exclusion and the report.)"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Iterator

import pytest

from hvdlite.recording import recorder as recorder_module
from hvdlite.recording.recorder import PeerWaitClock, ReductionCount, StepRecorder


@pytest.fixture
def ticks(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """perf_counter answers these times in order (the test appends them)."""
    times: list[float] = []

    def perf_counter() -> float:
        return times.pop(0)

    monkeypatch.setattr(recorder_module, "time", SimpleNamespace(perf_counter=perf_counter))
    return times


def engine_totals(values: list[tuple[float, int, int, int]]) -> Iterator:
    """The engine's running totals at each boundary, as fresh objects like real sums."""
    for peer, sent, received, estimated in values:
        yield peer, int(str(sent)), int(str(received)), int(str(estimated))


def test_the_window_is_the_mean_per_step_between_the_first_and_last_boundary(
        ticks: list[float]) -> None:
    totals = engine_totals([(0.5, 100, 50, 1000), (1.0, 200, 60, 1000), (1.5, 300, 70, 1000),
                            (2.0, 401, 450, 1000)])
    # (reductions, tensors, bytes): the engine's ReductionCount at each boundary
    reduced = iter([(2, 20, 2000), (5, 50, 5000), (7, 70, 7000), (11, 110, 11300)])
    recorder = StepRecorder(lambda: next(totals), reduced=lambda: next(reduced))
    # Before the first boundary (set-up): a 2 s optimizer wait and a 0.5 s collective.
    ticks += [1.0, 3.0, 4.0]
    recorder.optimizer_wait_begin()
    recorder.optimizer_wait_end(1.0)           # the time begin returned
    recorder.collective_wait(0.5)
    recorder.step_done()                       # at 4.0
    ticks += [5.0, 5.5, 7.0, 8.0, 10.0, 10.5, 14.5]
    started = recorder.optimizer_wait_begin()
    recorder.optimizer_wait_end(started)       # 0.5 s
    recorder.collective_wait(0.75)
    recorder.step_done()                       # at 7.0
    started = recorder.optimizer_wait_begin()
    recorder.optimizer_wait_end(started)       # 2.0 s
    recorder.collective_wait(0.5)
    recorder.step_done()                       # at 10.5
    recorder.step_done()                       # at 14.5
    assert ticks == []
    window = recorder.window()
    assert window == {
        "steps": 3,
        "step_time_s": pytest.approx(10.5 / 3),
        # steps of 3.0, 3.5 and 4.0 s: 0.5 s from their median, as a normal's deviation
        "step_time_sd_s": pytest.approx(1.4826 * 0.5),
        "optimizer_wait_s": pytest.approx(2.5 / 3),
        "other_wait_s": pytest.approx(1.25 / 3),
        "peer_wait_s": pytest.approx(1.5 / 3),
        "bytes_sent": pytest.approx(301 / 3),
        "bytes_received": pytest.approx(400 / 3),
        "bytes_estimated": False,              # no estimated bytes inside the window
        "allreduce_calls": pytest.approx(9 / 3),
        "allreduce_tensors": pytest.approx(90 / 3),
        "allreduce_bytes": pytest.approx(9300 / 3),
    }
    assert (recorder.comm_wait, recorder.other_wait) == (4.5, 1.75)
    assert recorder.steps == 4 and recorder.other_calls == 3


def test_estimated_bytes_inside_the_window_are_flagged(ticks: list[float]) -> None:
    totals = engine_totals([(0.0, 0, 0, 7), (0.0, 10, 10, 8)])
    recorder = StepRecorder(lambda: next(totals))
    ticks += [1.0, 2.0]
    recorder.step_done()
    recorder.step_done()
    window = recorder.window()
    assert window["steps"] == 1 and window["step_time_s"] == 1.0
    assert window["bytes_estimated"] is True


def test_fewer_than_two_boundaries_make_no_window(ticks: list[float]) -> None:
    recorder = StepRecorder(lambda: (0.0, 0, 0, 0))
    assert recorder.window() == {"steps": 0}
    ticks.append(1.0)
    recorder.step_done()
    assert recorder.window() == {"steps": 0}


@pytest.mark.parametrize("every,expected", [(3, [1, 4, 7]), (1, [1, 2, 3, 4, 5, 6, 7, 8]),
                                            (None, [1, 17, 33])])
def test_the_gpu_is_sampled_on_the_first_step_and_every_n_after(
        ticks: list[float], every: int, expected: list[int]) -> None:
    sampled: list[int] = []
    steps = 40 if every is None else 8
    kwargs = {} if every is None else {"sample_every": every}
    recorder = StepRecorder(lambda: (0.0, 0, 0, 0), lambda: sampled.append(recorder.steps),
                            **kwargs)
    ticks += [float(i) for i in range(steps)]
    for _ in range(steps):
        recorder.step_done()
    assert sampled == expected


def test_a_few_slow_steps_do_not_pass_for_a_wide_spread(ticks: list[float]) -> None:
    recorder = StepRecorder(lambda: (0.0, 0, 0, 0))
    ticks += [0.0, 9.0, 11.0, 13.0, 15.0, 17.0]      # a 9 s warm-up, then steps of 2 s
    for _ in range(6):
        recorder.step_done()
    window = recorder.window()
    assert window["step_time_s"] == 17.0 / 5 and window["step_time_sd_s"] == 0.0
    assert window["allreduce_calls"] == window["allreduce_bytes"] == 0.0   # none counted


def test_the_spread_is_of_the_latest_steps(ticks: list[float],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(recorder_module, "RECENT_STEPS", 4)
    recorder = StepRecorder(lambda: (0.0, 0, 0, 0))
    times = [0.0, 1.0, 3.0, 6.0, 10.0]              # steps of 1, 2, 3, 4 s ...
    times += [times[-1] + 1.0 * i for i in range(1, 5)]   # ... then four of 1 s
    ticks += times
    for _ in times:
        recorder.step_done()
    assert recorder.window()["step_time_sd_s"] == 0.0   # the first four are overwritten


def test_one_rank_gradients_count_as_reductions(ticks: list[float]) -> None:
    """On one rank the optimizer reduces nothing and says so, per gradient."""
    recorder = StepRecorder(lambda: (0.0, 0, 0, 0), reduced=lambda: (1, 1, 4))  # a metric
    ticks += [0.0, 1.0, 2.0]
    recorder.step_done()
    for _ in range(2):
        recorder.unreduced(1000)
        recorder.unreduced(24)
        recorder.step_done()
    window = recorder.window()
    assert (window["allreduce_calls"], window["allreduce_tensors"]) == (2.0, 2.0)
    assert window["allreduce_bytes"] == 1024.0


def test_the_reduction_count_adds_whole_triples() -> None:
    count = ReductionCount()
    count.add(3, 1200)
    count.add(1, 4)
    assert count.totals == (2, 4, 1204)


def test_the_peer_wait_clock_works_from_any_origin() -> None:
    clock = PeerWaitClock()
    clock.submitted(0.25)                     # monotonic time has no fixed origin
    assert clock.since == 0.25
    clock.settled(0.75)
    assert clock.total == 0.5 and clock.since is None
    clock.settled(5.0)                        # nothing open: nothing counted
    assert clock.total == 0.5
