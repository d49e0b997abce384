"""The stall inspector, without MPI: when rank 0 looks for stalled tensors, what it
warns about (once, with global ranks) and when a stall becomes an error."""
from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Iterator

import pytest

from hvdlite.failure import stall
from hvdlite.negotiation.coordinator import Coordinator
from hvdlite.negotiation.requests import Descriptor, Kind


def config(check: float, shutdown: float) -> SimpleNamespace:
    return SimpleNamespace(stall_check_time=check, stall_shutdown_time=shutdown)


class Clock:
    """Stands in for time.monotonic in the inspector."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class CountingCoordinator:
    """Reports no stall and records when the inspector looks, and for what threshold."""

    def __init__(self) -> None:
        self.looks: list[tuple[float, float]] = []

    def stalled(self, now: float, after: float) -> list:
        self.looks.append((now, after))
        return []

    def mark_warned(self, name: str) -> bool:  # pragma: no cover - nothing is stalled
        raise AssertionError("nothing is stalled")


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock(100.0)
    monkeypatch.setattr(stall, "time", SimpleNamespace(monotonic=fake))
    return fake


class Recorder(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def warnings() -> Iterator[list[str]]:
    """The hvdlite logger's warnings (whether or not it propagates to the root logger)."""
    logger = logging.getLogger("hvdlite")
    recorder, level = Recorder(), logger.level
    logger.addHandler(recorder)
    logger.setLevel(logging.WARNING)
    yield recorder.messages
    logger.removeHandler(recorder)
    logger.setLevel(level)


def submitted(size: int, ranks: list[int], name: str, at: float) -> Coordinator:
    coordinator = Coordinator(size=size)
    for rank in ranks:
        coordinator.ingest(rank, [(Descriptor(name=name, kind=Kind.ALLREDUCE, dtype="float32",
                                              shape=(4,)), 0.0)], now=at)
    return coordinator


@pytest.mark.parametrize("check,shutdown,after", [
    (60.0, 0.0, 15.0), (0.0, 20.0, 5.0), (60.0, 20.0, 5.0), (8.0, 40.0, 2.0), (0.0, 10.0, 2.5),
    (0.5, 0.0, 0.125), (0.0, 0.25, 0.0625), (0.0, 0.0, None)])
def test_report_after_is_a_quarter_of_the_smallest_threshold_in_force(
        check: float, shutdown: float, after: float) -> None:
    assert stall.report_after(config(check, shutdown)) == after


def test_an_inspector_with_both_thresholds_off_never_looks(clock: Clock) -> None:
    coordinator = CountingCoordinator()
    inspector = stall.StallInspector(config(0.0, 0.0), (0,))
    for clock.now in (100.0, 1e6):
        assert inspector.check(coordinator) is None  # type: ignore[arg-type]
    assert coordinator.looks == []


def test_looks_at_most_every_quarter_threshold_and_at_most_every_second(clock: Clock) -> None:
    # A 2 s threshold: a look every 0.5 s. (Times are exact binary fractions.)
    coordinator = CountingCoordinator()
    inspector = stall.StallInspector(config(2.0, 0.0), (0, 1))
    for clock.now in (100.0, 100.4375, 100.5, 100.9375, 101.0):
        inspector.check(coordinator)  # type: ignore[arg-type]
    assert coordinator.looks == [(100.0, 2.0), (100.5, 2.0), (101.0, 2.0)]
    # A 40 s threshold: a look every second, not every 10 s; the shutdown check too.
    coordinator = CountingCoordinator()
    inspector = stall.StallInspector(config(40.0, 60.0), (0, 1))
    for clock.now in (200.0, 200.875, 201.0, 201.5, 202.0):
        inspector.check(coordinator)  # type: ignore[arg-type]
    assert coordinator.looks == [(200.0, 40.0), (200.0, 60.0), (201.0, 40.0), (201.0, 60.0),
                                 (202.0, 40.0), (202.0, 60.0)]


def test_the_first_check_looks_at_once_and_sub_second_thresholds_count(clock: Clock) -> None:
    coordinator = CountingCoordinator()
    inspector = stall.StallInspector(config(0.5, 0.75), (0,))
    clock.now = 0.0                       # monotonic time has no fixed origin
    inspector.check(coordinator)  # type: ignore[arg-type]
    assert coordinator.looks == [(0.0, 0.5), (0.0, 0.75)]


def test_sub_second_thresholds_warn_and_stop(clock: Clock, warnings: list[str]) -> None:
    coordinator = submitted(2, [1], "grad", at=100.0)
    inspector = stall.StallInspector(config(0.5, 0.0), (0, 1))
    clock.now = 100.5
    assert inspector.check(coordinator) is None
    assert len(warnings) == 1 and warnings[0].startswith("Stall: for 0.5 s ranks [1]")
    inspector = stall.StallInspector(config(0.0, 0.75), (0, 1))
    clock.now = 100.75
    message = inspector.check(coordinator)
    assert message is not None and message.endswith("HVDLITE_STALL_SHUTDOWN_TIME=0.75 s.")


def test_a_stall_is_warned_once_with_global_ranks(
        clock: Clock, warnings: list[str]) -> None:
    # Set ranks 0 and 2 submitted "grad" at t=100; set rank 1 (global rank 7) did not.
    coordinator = submitted(3, [0, 2], "grad", at=100.0)
    inspector = stall.StallInspector(config(4.0, 0.0), (5, 7, 9))
    clock.now = 103.0
    assert inspector.check(coordinator) is None
    assert warnings == []                       # waited 3 s of 4
    clock.now = 104.0
    assert inspector.check(coordinator) is None       # a warning, not an error
    (message,) = warnings
    assert message.startswith("Stall: for 4.0 s ranks [5, 9] have been waiting on tensor "
                              "'grad', which ranks [7] have not submitted (missing ranks: [7]).")
    for clock.now in (105.0, 110.0):
        assert inspector.check(coordinator) is None
    assert len(warnings) == 1                   # once per tensor


def test_a_stall_past_the_shutdown_time_is_an_error_naming_the_first_stalled(
        clock: Clock, warnings: list[str]) -> None:
    # "first" waits from t=100 for set rank 0, "second" from t=101 for set rank 1.
    coordinator = submitted(2, [1], "first", at=100.0)
    coordinator.ingest(0, [(Descriptor(name="second", kind=Kind.ALLREDUCE, dtype="float32",
                                       shape=(4,)), 0.0)], now=101.0)
    inspector = stall.StallInspector(config(0.0, 5.0), (3, 4))
    clock.now = 104.75
    assert inspector.check(coordinator) is None
    clock.now = 106.0                                 # both have waited 5 s or more
    message = inspector.check(coordinator)
    assert message is not None
    assert message.startswith("Stall: for 6.0 s ranks [4] have been waiting on tensor 'first'")
    assert message.endswith(" Stopping: stalled longer than HVDLITE_STALL_SHUTDOWN_TIME=5 s.")
    assert warnings == []                       # the check time is off: no warning


def test_a_stall_is_warned_before_it_becomes_an_error(
        clock: Clock, warnings: list[str]) -> None:
    coordinator = submitted(2, [0], "grad", at=100.0)
    inspector = stall.StallInspector(config(2.0, 5.0), (0, 1))
    clock.now = 103.0
    assert inspector.check(coordinator) is None
    assert len(warnings) == 1
    clock.now = 105.5
    message = inspector.check(coordinator)
    assert message is not None and "for 5.5 s ranks [0]" in message
    assert "HVDLITE_STALL_SHUTDOWN_TIME=5 s." in message
    assert len(warnings) == 1
