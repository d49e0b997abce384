"""The deadlock watch without MPI: each rank's flag bits, the coordinator's timing of
the all-blocked streak, its verdict, and the message; and the engine at one rank
(tests/unit/engine_rig.py) acting on a verdict."""
from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from hvdlite.errors import DeadlockError
from hvdlite.failure import deadlock
from hvdlite.failure.deadlock import BLOCKED, NO_DEADLOCK_CHECK, DeadlockWatch, describe
from hvdlite.negotiation.coordinator import Report, Verdict
from hvdlite.negotiation.requests import Response
from tests.unit.engine_rig import allreduce, outcome, second_set, set_up
from tests.unit.test_negotiation import d

pytestmark = pytest.mark.timeout(60)

SETS = {0: (0, 1, 2), 4: (1, 2)}


class Handles:
    """What the watch reads of a HandleTable."""

    def __init__(self) -> None:
        self.waiting = 0
        self.created = 0
        self.parked_now: set[int] = set()

    def parked(self) -> set[int]:
        return set(self.parked_now)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [100.0]
    monkeypatch.setattr(deadlock, "time", SimpleNamespace(monotonic=lambda: now[0]))
    return now


def watch(handles: Handles, stall_check_time: float = 2.0) -> DeadlockWatch:
    return DeadlockWatch(handles, SimpleNamespace(stall_check_time=stall_check_time), True)


def test_a_rank_is_blocked_when_a_thread_waits_and_nothing_moved() -> None:
    handles = Handles()
    w = watch(handles)
    assert w.flags(busy=False) == NO_DEADLOCK_CHECK          # nobody waits
    handles.waiting = 1
    assert w.flags(busy=False) == BLOCKED | NO_DEADLOCK_CHECK
    assert w.flags(busy=True) == NO_DEADLOCK_CHECK           # a collective is running
    handles.created += 1                                      # a submission since
    assert w.flags(busy=False) == NO_DEADLOCK_CHECK
    w.agreed += 1                                             # an agreement since
    assert w.flags(busy=False) == NO_DEADLOCK_CHECK
    assert w.flags(busy=False) == BLOCKED | NO_DEADLOCK_CHECK


def all_blocked(w: DeadlockWatch, clock: list[float], seconds: float) -> None:
    """Rounds in which every rank said it was blocked, for ``seconds``."""
    end = clock[0] + seconds
    while clock[0] < end:
        w.observe(BLOCKED | NO_DEADLOCK_CHECK)
        clock[0] += 0.1


def test_the_check_is_due_after_half_the_stall_check_time(clock: list[float]) -> None:
    w = watch(Handles(), stall_check_time=2.0)
    all_blocked(w, clock, 0.9)
    assert not w.due
    w.observe(NO_DEADLOCK_CHECK)                              # one rank was not blocked
    all_blocked(w, clock, 0.9)
    assert not w.due
    all_blocked(w, clock, 0.3)
    assert w.due and not w.flags(busy=False) & NO_DEADLOCK_CHECK   # asks every rank


def test_no_check_without_a_stall_check_time(clock: list[float]) -> None:
    w = watch(Handles(), stall_check_time=0.0)
    all_blocked(w, clock, 100.0)
    assert not w.due


def pending_of(rank: int) -> deadlock.Pending:
    return {0: [(0, "metric", "allreduce", True)],
            1: [(0, "grad", "allreduce", True), (4, "side", "allgather", False)],
            2: [(0, "grad", "allreduce", True), (4, "side", "allgather", True)]}[rank]


def verdict(w: DeadlockWatch, reports: list[Report], responses: list[Response]) -> str:
    w.observe(BLOCKED)                                        # the checking round
    assert w.checking
    return w.judge(reports, responses, SETS)


def test_the_verdict_needs_every_rank_blocked_and_nothing_agreed(clock: list[float]) -> None:
    w = watch(Handles(), stall_check_time=2.0)
    reports = [Report([], False, pending=pending_of(r)) for r in range(3)]
    all_blocked(w, clock, 1.2)
    assert w.due
    message = verdict(w, reports, [])
    assert re.match(r"Deadlock: for 1\.[23] s every rank has been waiting", message), message
    assert not w.due
    all_blocked(w, clock, 1.2)
    assert verdict(w, reports[:2] + [Report([], False)], []) == ""     # rank 2 moved
    all_blocked(w, clock, 1.2)
    assert verdict(w, reports, [Response(d(name="grad"))]) == ""       # agreed meanwhile
    w.observe(BLOCKED | NO_DEADLOCK_CHECK)                    # not a checking round
    assert w.judge(reports, [], SETS) == ""


def test_pending_lists_what_user_threads_wait_on_when_asked() -> None:
    handles = Handles()
    w = watch(handles)
    handles.waiting, handles.parked_now = 1, {7}

    def request(handle: int, name: str) -> Any:
        return SimpleNamespace(handle=handle, desc=d(name=name))
    members = [SimpleNamespace(set_id=0, pending={"a": request(7, "a"), "b": request(8, "b")})]
    w.flags(busy=False)
    w.flags(busy=False)                                       # blocked
    w.observe(BLOCKED | NO_DEADLOCK_CHECK)
    assert w.pending(members) is None                         # not asked
    w.observe(BLOCKED)
    assert w.pending(members) == [(0, "a", "allreduce", True), (0, "b", "allreduce", False)]


def test_the_message_names_what_each_rank_waits_on_and_who_is_missing() -> None:
    message = describe([pending_of(r) for r in range(3)], SETS, 30.0)
    assert ("rank 0 waits on allreduce 'metric' (not submitted by ranks [1, 2]); "
            "rank 1 waits on allreduce 'grad' (not submitted by ranks [0]); "
            "rank 2 waits on allreduce 'grad' (not submitted by ranks [0]), allgather 'side' "
            "on process set 4 (ranks [1, 2]). Likely cause: the ranks ran different numbers "
            "of batches") in message
    for hint in ("steps_per_epoch", "ElasticSampler", "hvd.join()"):
        assert hint in message
    # The same picture when a rank skipped a step's collectives under a condition of
    # its own: named as the other likely cause.
    assert ("a collective is called on some ranks only: under a condition that holds on "
            "some ranks and not others (a step skipped where the rank's own gradients are "
            "not finite, checked before they are averaged") in message


def test_a_rank_in_join_is_named_so_and_not_missing_from_allreduces() -> None:
    pending = [[(0, "join", "join", True)],
               [(0, "a", "allreduce", True)],
               [(0, "b", "allreduce", True), (0, "c", "broadcast", True)]]
    message = describe(pending, SETS, 1.0)
    assert ("rank 0 is in join(); rank 1 waits on allreduce 'a' (not submitted by ranks [2]); "
            "rank 2 waits on allreduce 'b' (not submitted by ranks [1]), broadcast 'c' (not "
            "submitted by ranks [0, 1])") in message


def test_a_long_list_is_cut_short() -> None:
    mine = [(0, f"g{i}", "allreduce", True) for i in range(10)]
    message = describe([mine, []], {0: (0, 1)}, 1.0)
    assert "allreduce 'g2' (not submitted by ranks [1]) and 7 more; rank 1 has nothing" in message


def test_the_engine_fails_what_every_set_has_pending_on_a_verdict_and_goes_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    engine = set_up()
    other = second_set(engine)
    handles = [engine.submit(allreduce("x")), engine.submit(allreduce("y", other))]
    real = engine._decide
    told = []

    def decide(state: Any, gathered: list) -> Verdict:
        if state.set_id == 0 and not told:        # the coordinator's verdict, once
            told.append(True)
            return Verdict([], [], "", "Deadlock: stuck.")
        return real(state, gathered)
    monkeypatch.setattr(engine, "_decide", decide)
    assert engine._iteration()
    for handle in handles:
        error = outcome(engine, handle)
        assert isinstance(error, DeadlockError) and str(error) == "rank 0: Deadlock: stuck."
    assert engine.dead is None and not any(s.pending for s in engine.registry.members())
    again = engine.submit(allreduce("x"))                 # the name is free again
    engine._iteration()
    np.testing.assert_array_equal(outcome(engine, again), [1.0, 2.0, 3.0])
