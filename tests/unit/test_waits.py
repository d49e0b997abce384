"""hvdlite/transport/waits.py: how the engine thread waits inside a data collective.
Requests here complete on events (a tick having run), never after a sleep."""
from __future__ import annotations

import threading
from typing import Callable

import pytest

from hvdlite.transport import waits


class Polled:
    """An MPI request: complete once ``done()`` says so; counts its Tests and Waits."""

    def __init__(self, done: Callable[[], bool]) -> None:
        self._done, self.tests, self.waits = done, 0, 0

    def Test(self) -> bool:  # noqa: N802 (mpi4py's name)
        self.tests += 1
        return self._done()

    def Wait(self) -> None:  # noqa: N802
        self.waits += 1


class Blocking:
    """A BlockingPending: complete once ``done()`` says so; records its timeouts."""

    def __init__(self, done: Callable[[], bool]) -> None:
        self._done, self.timeouts = done, []

    def wait_for(self, timeout_s: float) -> bool:
        self.timeouts.append(timeout_s)
        return self._done()


class Lost(Exception):
    pass


@pytest.fixture(autouse=True)
def unwatched() -> None:
    """Unit tests that run an engine's set-up on this thread (engine_rig) leave it
    watched: each test here starts and ends without a watch."""
    waits.watch(None)
    yield
    waits.watch(None)


@pytest.fixture
def ticks() -> list[tuple[float, float]]:
    """This thread's watch, recording each tick; removed after the test."""
    seen: list[tuple[float, float]] = []
    waits.watch(lambda started, now: seen.append((started, now)), every_s=0.01)
    yield seen
    waits.watch(None)


def test_unwatched_waits_block_as_the_library_does() -> None:
    request = Polled(lambda: False)
    waits.wait_all([request, request])
    assert request.waits == 2 and request.tests == 0
    blocking = Blocking(lambda: True)
    waits.wait_blocked([blocking])
    assert blocking.timeouts == [waits._UNWATCHED_SLICE_S]


def test_a_watched_wait_that_completes_at_once_never_ticks(ticks: list) -> None:
    request = Polled(lambda: True)
    waits.wait_all([request])
    waits.wait_blocked([Blocking(lambda: True)])
    assert request.tests == 1 and request.waits == 0 and ticks == []


def test_a_lasting_polled_wait_ticks_from_its_start_until_complete(ticks: list) -> None:
    request = Polled(lambda: len(ticks) >= 3)       # completes once three ticks ran
    waits.wait_all([request])
    assert len(ticks) == 3 and request.waits == 0
    started = {s for s, _ in ticks}
    assert len(started) == 1 and all(now >= s + 0.01 for s, now in ticks)


def test_a_lasting_blocked_wait_ticks_until_complete(ticks: list) -> None:
    request = Blocking(lambda: len(ticks) >= 2)
    waits.wait_blocked([request])
    assert len(ticks) == 2 and all(t <= 0.01 for t in request.timeouts)


def test_a_tick_that_raises_abandons_the_wait() -> None:
    def give_up(started: float, now: float) -> None:
        raise Lost(f"after {now - started:.2f} s")
    waits.watch(give_up, every_s=0.01)
    try:
        with pytest.raises(Lost):
            waits.wait_all([Polled(lambda: False)])
        with pytest.raises(Lost):
            waits.wait_blocked([Blocking(lambda: False)])
    finally:
        waits.watch(None)


def test_the_watch_is_the_marking_threads_own(ticks: list) -> None:
    """Another thread's waits (a user's, a tool's) block; they never run the engine's tick."""
    request = Polled(lambda: False)
    other = threading.Thread(target=waits.wait_all, args=([request],))
    other.start()
    other.join()
    assert request.waits == 1 and request.tests == 0 and ticks == []


def test_a_wait_loop_of_its_own_ticks_only_where_watched(ticks: list) -> None:
    waits.tick_if_watched(1.0, 2.0)
    assert ticks == [(1.0, 2.0)]
    waits.watch(None)
    waits.tick_if_watched(1.0, 3.0)
    assert ticks == [(1.0, 2.0)]


def test_a_watched_wait_yields_its_core_before_every_poll_after_the_first(
        ticks: list, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where ranks outnumber cores the peer a collective waits for may be the one
    sharing this core: each poll that finds it incomplete hands the core over."""
    request = Polled(lambda: request.tests >= 5)
    yields: list[int] = []
    monkeypatch.setattr(waits.os, "sched_yield", lambda: yields.append(request.tests))
    waits.wait_all([request])
    assert yields == [1, 2, 3, 4] and request.tests == 5
