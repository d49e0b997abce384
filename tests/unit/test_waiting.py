"""How the engine waits for a round, without MPI and without real time: a fake clock
(each perf_counter read costs 1 us) and fake MPI requests that complete at a set
time show the wait's schedule: spin while someone waits, else sleep in doubling
pauses, ticks once a wait lasts, and plain sleeps after a ring."""
from __future__ import annotations

import ctypes
import threading
import time
from types import SimpleNamespace
from typing import Callable, Optional

import pytest

from hvdlite.failure import liveness, waiting
from hvdlite.failure.waiting import Doorbell, RoundWaiter

US = 1e-6


class World:
    """The waiter's clock, sleeps, doorbell and MPI, all fake."""

    def __init__(self, done_after: float, ring_at_listen: Optional[int] = None,
                 start: float = 1000.0) -> None:
        self.start = self.now = start
        self.done_at = self.start + done_after
        self.tests = 0
        self.events: list[tuple[str, float]] = []     # ("listen" | "sleep", seconds)
        self.queue: list[str] = []                    # local requests for the next round
        self.ring_at_listen = ring_at_listen          # local work arrives in this listen

    # time
    def perf_counter(self) -> float:
        self.now += US
        return self.now

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.events.append(("sleep", seconds))
        self.now += seconds

    # waiting.all_done
    def Testall(self, requests: list) -> bool:  # noqa: N802
        assert requests == ["round"]
        self.tests += 1
        return self.now >= self.done_at

    # the doorbell
    def listen(self, timeout: float, ready: Callable[[], bool]) -> bool:
        self.events.append(("listen", timeout))
        if self.ring_at_listen == len(self.events):
            self.queue.append("new")                   # a submission rings the bell
            return ready()
        if ready():
            return True
        self.now += timeout
        return False

    def pauses(self, kind: str = "listen") -> list[float]:
        return [round(s / US, 6) for k, s in self.events if k == kind]


def run(world: World, monkeypatch: pytest.MonkeyPatch, spin_us: float = 0.0,
        cycle_ms: float = 1.0, waiting_users: int = 0) -> list[tuple[float, float]]:
    """One wait; the on_tick calls it made."""
    monkeypatch.setattr(waiting, "time", SimpleNamespace(
        perf_counter=world.perf_counter, monotonic=world.monotonic, sleep=world.sleep))
    monkeypatch.setattr(waiting, "all_done", world.Testall)
    ticks: list[tuple[float, float]] = []
    config = SimpleNamespace(spin_time=spin_us, cycle_time=cycle_ms)
    waiter = RoundWaiter(config, SimpleNamespace(waiting=waiting_users),
                         lambda started, now: ticks.append((started, now)),
                         world, lambda: len(world.queue))  # type: ignore[arg-type]
    waiter.wait(iter(["round"]))                       # any sequence, read more than once
    return ticks


def test_a_completed_round_returns_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    world = World(done_after=0.0)
    assert run(world, monkeypatch, spin_us=100, waiting_users=1) == []
    assert world.tests == 1 and world.events == []


def test_an_idle_wait_sleeps_in_pauses_doubling_up_to_a_quarter_cycle(
        monkeypatch: pytest.MonkeyPatch) -> None:
    world = World(done_after=0.002)
    assert run(world, monkeypatch, spin_us=100, cycle_ms=1.0) == []
    pauses = world.pauses()
    assert pauses[:7] == [20, 40, 80, 160, 250, 250, 250]
    assert set(pauses[4:]) == {250} and world.pauses("sleep") == []
    assert world.tests == len(pauses) + 1              # one test per pause: no spinning


def test_the_longest_pause_is_at_least_50_us(monkeypatch: pytest.MonkeyPatch) -> None:
    world = World(done_after=0.0005)
    run(world, monkeypatch, cycle_ms=0.1)              # a quarter cycle is 25 us
    pauses = world.pauses()
    assert pauses[:4] == [20, 40, 50, 50] and set(pauses[2:]) == {50}


def test_a_lasting_wait_ticks_every_tick_from_when_it_reached_the_longest_pause(
        monkeypatch: pytest.MonkeyPatch) -> None:
    world = World(done_after=4.5 * liveness.TICK_S)
    ticks = run(world, monkeypatch, cycle_ms=100.0)    # pauses up to 25 ms
    # The clock is first read after the first longest pause, the 12th.
    first_long = world.start + sum(p for _, p in world.events[:12])
    assert world.pauses()[:12] == [20 * 2 ** i for i in range(11)] + [25000]
    assert len(ticks) == 3
    assert [started for started, _ in ticks] == pytest.approx([first_long] * 3)
    times = [first_long] + [now for _, now in ticks]
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert all(liveness.TICK_S <= gap < liveness.TICK_S + 0.026 for gap in gaps)


def test_a_short_wait_never_ticks(monkeypatch: pytest.MonkeyPatch) -> None:
    world = World(done_after=0.9 * liveness.TICK_S)
    assert run(world, monkeypatch, cycle_ms=100.0) == []


def test_a_waiting_user_makes_the_engine_spin_for_its_budget_then_sleep(
        monkeypatch: pytest.MonkeyPatch) -> None:
    world = World(done_after=0.001, start=0.0)        # perf_counter has no fixed origin
    run(world, monkeypatch, spin_us=100, waiting_users=1)
    first_pause = next(i for i, (kind, _) in enumerate(world.events) if kind == "listen")
    assert first_pause == 0
    # About 100 us of 1 us clock reads went by, testing the round all along, before
    # the first pause (the budget is checked after each 20 us slice).
    spun = world.tests - len(world.pauses()) - 1
    assert 90 <= spun <= 120
    assert world.pauses()[:3] == [20, 40, 80]


def test_a_spin_ends_the_moment_the_round_completes(monkeypatch: pytest.MonkeyPatch) -> None:
    world = World(done_after=30 * US)
    run(world, monkeypatch, spin_us=1000, waiting_users=1)
    assert world.events == [] and world.now < world.done_at + 3 * US


def test_no_spin_budget_means_no_spin(monkeypatch: pytest.MonkeyPatch) -> None:
    world = World(done_after=0.0003)
    run(world, monkeypatch, spin_us=0, waiting_users=1)
    assert world.tests == len(world.pauses()) + 1


def test_local_work_during_a_pause_makes_the_engine_spin(monkeypatch: pytest.MonkeyPatch) -> None:
    # The third pause ends at a ring: from then on the engine spins (budget 1 ms).
    world = World(done_after=0.0008, ring_at_listen=3)
    run(world, monkeypatch, spin_us=1000)
    assert world.pauses() == [20, 40, 80]
    assert world.now < world.done_at + 25 * US         # completion seen within a slice


def test_after_a_ring_without_spin_budget_pauses_are_plain_sleeps(
        monkeypatch: pytest.MonkeyPatch) -> None:
    world = World(done_after=0.0015, ring_at_listen=2)
    run(world, monkeypatch, spin_us=0)
    assert world.pauses() == [20, 40]
    sleeps = world.pauses("sleep")
    assert sleeps[:4] == [40, 80, 160, 250] and set(sleeps[3:]) == {250}


def test_work_queued_before_the_wait_does_not_count_as_new(
        monkeypatch: pytest.MonkeyPatch) -> None:
    world = World(done_after=0.0003)
    world.queue += ["old"] * 300                       # counts beyond cached small ints
    run(world, monkeypatch, spin_us=1000)
    assert world.pauses()[:3] == [20, 40, 80] and world.pauses("sleep") == []


class BlockingRound:
    """A round that a library completes on its own threads (torch's Gloo): the waiter
    blocks in ``wait_for``, here advancing the fake clock by what it asks, or by the
    next of ``lengths`` (fractions of it: a real wait may end early, or late)."""

    def __init__(self, world: World, lengths: tuple[float, ...] = (1.0,)) -> None:
        self.world = world
        self.timeouts: list[float] = []
        self._lengths = lengths

    def Test(self) -> bool:  # noqa: N802
        raise AssertionError("a blocking round is waited on, not polled")

    def wait_for(self, timeout_s: float) -> bool:
        length = self._lengths[len(self.timeouts) % len(self._lengths)]
        self.timeouts.append(timeout_s)
        world = self.world
        world.now = min(world.now + max(timeout_s, 1e-3) * length,
                        max(world.now, world.done_at))
        return world.now >= world.done_at


def run_blocking(world: World, monkeypatch: pytest.MonkeyPatch, count: int = 1,
                 waiting_users: int = 1, lengths: tuple[float, ...] = (1.0,)
                 ) -> tuple[list[BlockingRound], list[float]]:
    """One wait on ``count`` blocking rounds; the rounds and the times of on_tick calls."""
    monkeypatch.setattr(waiting, "time", SimpleNamespace(
        perf_counter=world.perf_counter, monotonic=world.monotonic, sleep=world.sleep))
    ticks: list[float] = []

    def on_tick(started: float, now: float) -> None:
        assert started == world.start
        ticks.append(now)
    config = SimpleNamespace(spin_time=1000.0, cycle_time=1.0)
    waiter = RoundWaiter(config, SimpleNamespace(waiting=waiting_users), on_tick,
                         world, lambda: len(world.queue))  # type: ignore[arg-type]
    rounds = [BlockingRound(world, lengths) for _ in range(count)]
    waiter.wait(rounds)
    return rounds, ticks


def test_a_blocking_round_is_waited_on_blocked_neither_polled_nor_spun(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Even with a user waiting and a spin budget: spinning would not progress it.
    world = World(done_after=0.05)
    rounds, ticks = run_blocking(world, monkeypatch)
    assert ticks == [] and world.events == [] and world.tests == 0
    assert rounds[0].timeouts == pytest.approx([liveness.TICK_S])
    assert world.now == pytest.approx(world.done_at)


def test_a_lasting_blocking_wait_ticks_every_tick(monkeypatch: pytest.MonkeyPatch) -> None:
    world = World(done_after=3.5 * liveness.TICK_S)
    rounds, ticks = run_blocking(world, monkeypatch, count=2)
    assert ticks == pytest.approx([world.start + k * liveness.TICK_S for k in (1, 2, 3)])
    assert all(0 < t <= liveness.TICK_S + 1e-9 for t in rounds[0].timeouts)
    assert len(rounds[1].timeouts) == 1            # done by then: one look, no tick


def test_blocking_waits_that_end_early_or_late_tick_once_a_tick_has_passed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Waits end at half their timeout, then 1.3 times it: no tick before its time, and
    # one as soon as a wait ends after it, counted from then.
    world = World(done_after=5 * liveness.TICK_S)
    rounds, ticks = run_blocking(world, monkeypatch, lengths=(0.5, 1.3))
    times = [world.start] + ticks
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert len(ticks) == 4 and all(liveness.TICK_S <= g < 1.4 * liveness.TICK_S for g in gaps)
    assert len(rounds[0].timeouts) == 9


def test_a_round_without_wait_for_among_blocking_ones_is_polled(
        monkeypatch: pytest.MonkeyPatch) -> None:
    world = World(done_after=0.0003)
    monkeypatch.setattr(waiting, "all_done", lambda requests: world.Testall(["round"]))
    blocking = BlockingRound(world)
    monkeypatch.setattr(waiting, "time", SimpleNamespace(
        perf_counter=world.perf_counter, monotonic=world.monotonic, sleep=world.sleep))
    waiter = RoundWaiter(SimpleNamespace(spin_time=0.0, cycle_time=1.0),
                         SimpleNamespace(waiting=0), lambda s, n: None, world,
                         lambda: 0)  # type: ignore[arg-type]
    waiter.wait([blocking, object()])
    assert blocking.timeouts == [] and world.pauses()[:3] == [20, 40, 80]


@pytest.mark.skipif(not hasattr(ctypes, "CDLL"), reason="no ctypes")
def test_precise_sleeps_sets_this_threads_timer_slack_to_1_us() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        pr_get_timerslack = 30
        libc.prctl.restype = ctypes.c_long
        if libc.prctl(pr_get_timerslack, 0, 0, 0, 0) < 0:
            pytest.skip("no PR_GET_TIMERSLACK here")
    except (OSError, AttributeError):
        pytest.skip("not Linux")
    seen: list[int] = []

    def probe() -> None:                               # a thread of its own: slack is per thread
        waiting.precise_sleeps()
        seen.append(libc.prctl(pr_get_timerslack, 0, 0, 0, 0))

    thread = threading.Thread(target=probe)
    thread.start()
    thread.join(10)
    assert seen == [1000]



def test_precise_sleeps_is_quiet_where_prctl_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_libc(*args: object, **kwargs: object) -> None:
        raise OSError("no C library")

    monkeypatch.setattr(waiting.ctypes, "CDLL", no_libc)
    waiting.precise_sleeps()                           # not Linux: nothing to do, no error
    monkeypatch.setattr(waiting.ctypes, "CDLL", lambda *a, **k: SimpleNamespace())
    waiting.precise_sleeps()                           # a libc without prctl


@pytest.mark.timeout(90)
def test_a_burst_of_rings_wakes_a_listener_with_one_release() -> None:
    bell = Doorbell()
    releases: list[int] = []
    release = bell._release

    def counted() -> None:
        releases.append(1)
        release()
    bell._release = counted                            # type: ignore[method-assign]
    for _ in range(5):
        bell.ring()                                    # nobody listens yet
    assert releases == []
    woke: list[bool] = []
    listener = threading.Thread(target=lambda: woke.append(bell.listen(30.0, lambda: False)))
    listener.start()
    deadline = time.monotonic() + 30
    while not bell.listening:
        assert time.monotonic() < deadline, "the listener never listened"
        time.sleep(0.001)
    for _ in range(200):
        bell.ring()
    listener.join(60)
    assert woke == [True] and releases == [1]          # True: woken, not at its limit


@pytest.mark.timeout(60)
def test_the_doorbell_listens_no_longer_than_asked_and_takes_any_timeout() -> None:
    """Upper bounds far above what is asked, for a busy machine: they tell a limit kept
    from one ignored (a lock acquired without a timeout, or with -1: forever)."""
    bell = Doorbell()
    started = time.monotonic()
    assert bell.listen(0.02, lambda: False) is False
    assert 0.015 <= time.monotonic() - started < 10
    started = time.monotonic()
    assert bell.listen(-1.0, lambda: False) is False   # a negative timeout: no sleep
    assert time.monotonic() - started < 10


def test_ringing_a_rung_doorbell_again_is_harmless() -> None:
    bell = Doorbell()
    bell.ring_always()
    bell.ring_always()                                 # the lock is free already: no error
    bell.listening = True
    bell.ring()                                        # the same through ring()
    assert bell.listen(0.0, lambda: False) is False    # listening clears a stale ring
