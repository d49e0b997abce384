"""The engine in one process, at one rank (tests/unit/engine_rig.py): its idle
schedule, what counts as work, what its set-up decides, and the rounds it runs
(the fast path and full rounds). The tests drive a set-up engine's iterations
from the test thread. What the engine would do to the process or the job (the
exit guard, os._exit, MPI_Abort) is recorded instead (the ``world`` fixture)."""
from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from hvdlite.engine import engine as engine_module
from hvdlite.errors import HvdliteError, MismatchError
from hvdlite.failure import stall
from hvdlite.negotiation.process_sets import NO_FULL_ROUND, RANK_IDLE
from hvdlite.negotiation.requests import Descriptor, Kind, Request
from tests.unit import engine_rig
from tests.unit.engine_rig import (Bell, FullRounds, Records, Work, allreduce, engine_at_one_rank,
                                   marker, outcome, second_set, set_up)

pytestmark = pytest.mark.timeout(60)
world, log = engine_rig.world, engine_rig.log   # fixtures


# -- the idle schedule -------------------------------------------------------------------
@pytest.mark.parametrize("idle_tick_s, cycle_ms, wait_s", [
    (0.1, 1.5, 0.1), (0.1, 200.0, 0.2),      # MPI's tick
    (0.4, 1.5, 0.4), (0.4, 600.0, 0.6)])     # Gloo's
def test_with_only_the_world_an_idle_engine_waits_its_transports_tick_each_time(
        idle_tick_s: float, cycle_ms: float, wait_s: float) -> None:
    """Nobody waits on the rounds of an idle rank when the world is the only set: its
    peers' collectives need its own submission, which wakes it. It joins a round once
    per tick of its transport (one cycle if that is longer), for liveness and shutdowns."""
    engine = set_up(idle_tick_s, cycle_time=cycle_ms)
    engine._doorbell = bell = Bell()
    for _ in range(4):
        assert engine._iteration()
    assert bell.waits == pytest.approx([wait_s] * 4, rel=1e-9)
    assert bell.ready_answers == [False] * 4      # each wait asks whether work came meanwhile


def test_with_process_sets_an_idle_engine_waits_a_cycle_then_twice_as_long_up_to_64() -> None:
    engine = set_up(cycle_time=1.5)
    second_set(engine)
    engine._doorbell = bell = Bell()
    for _ in range(9):
        assert engine._iteration()
    assert bell.waits == pytest.approx([0.0015 * 2 ** min(i, 6) for i in range(9)], rel=1e-9)


@pytest.mark.parametrize("idle_tick_s", [0.1, 0.4])
@pytest.mark.parametrize("cycle_ms, waits_ms", [(30.0, [30, 60, 100, 100]),
                                                 (200.0, [200, 200, 200])])
def test_with_process_sets_idle_waits_stop_growing_at_a_tenth_of_a_second_or_one_cycle(
        idle_tick_s: float, cycle_ms: float, waits_ms: list[float]) -> None:
    """A member with work on a smaller set waits for this rank's next global round: an
    idle engine never sleeps past 0.1 s between rounds there, unless one cycle is
    already longer, even on a transport whose patient tick is longer."""
    engine = set_up(idle_tick_s, cycle_time=cycle_ms)
    second_set(engine)
    engine._doorbell = bell = Bell()
    for _ in waits_ms:
        assert engine._iteration()
    assert bell.waits == pytest.approx([w / 1000 for w in waits_ms], rel=1e-9)


class PeerAtWork:
    """Stands in for a set's round where another member rank has work: the AND of
    the round clears this rank's RANK_IDLE bit, as a busy peer's word would."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.idle_flags_sent: list[bool] = []

    def cleared(self) -> Any:
        return self.real.cleared()

    def start(self) -> Any:
        self.idle_flags_sent.append(bool(self.real.vector[0] & RANK_IDLE))
        self.real.vector[0] &= ~RANK_IDLE
        return self.real.start()

    def free(self) -> None:
        self.real.free()


def test_with_only_the_world_a_peer_at_work_does_not_wake_an_idle_engine() -> None:
    """The peer's collective completes when this rank submits its part, not at a tick:
    ticking for it would only add rounds that agree nothing, each taking CPU from
    training."""
    engine = set_up(cycle_time=3.0)
    engine._doorbell = bell = Bell()
    state = engine.registry.member(0)
    state.round = peer = PeerAtWork(state.round)
    for _ in range(3):
        assert engine._iteration()
    assert bell.waits == pytest.approx([0.1] * 3, rel=1e-9)
    assert peer.idle_flags_sent == [True] * 3      # this rank itself said it was idle


def test_with_process_sets_an_idle_engine_ticks_every_cycle_while_a_peer_has_work() -> None:
    """A member with work on a smaller set waits for this rank's next global round:
    while any rank's word says it is busy, an idle engine does not slow down."""
    engine = set_up(cycle_time=3.0)
    second_set(engine)
    engine._doorbell = bell = Bell()
    state = engine.registry.member(0)
    state.round = peer = PeerAtWork(state.round)
    for _ in range(4):
        assert engine._iteration()
    assert bell.waits == pytest.approx([0.003] * 4, rel=1e-9)
    assert peer.idle_flags_sent == [True] * 4      # this rank itself said it was idle
    state.round = peer.real                        # the peer is done: back off again
    for _ in range(3):
        assert engine._iteration()
    assert bell.waits[4:] == pytest.approx([0.003, 0.006, 0.012], rel=1e-9)


def test_a_peer_at_work_on_any_one_set_keeps_an_idle_engine_ticking() -> None:
    """This rank is in two sets; a member of the smaller one has work, the global
    set's round says everyone is idle: one busy set is enough."""
    engine = set_up(cycle_time=3.0)
    engine._doorbell = bell = Bell()
    other = engine.registry.member(second_set(engine))
    other.round = PeerAtWork(other.round)
    for _ in range(3):
        assert engine._iteration()
    assert bell.waits == pytest.approx([0.003] * 3, rel=1e-9)


def test_a_rank_with_work_does_not_say_it_is_idle() -> None:
    engine = set_up()
    state = engine.registry.member(0)
    state.round = peer = PeerAtWork(state.round)
    handle = engine.submit(allreduce("busy"))
    engine._iteration()
    np.testing.assert_array_equal(outcome(engine, handle), [1.0, 2.0, 3.0])
    engine._doorbell = Bell()
    engine._iteration()
    assert peer.idle_flags_sent == [False, True]


@pytest.mark.parametrize("sets", [1, 2])
def test_work_wakes_an_idle_engine_at_once_then_it_waits_as_before(sets: int) -> None:
    """With process sets, the schedule starts again at one cycle."""
    engine = set_up(cycle_time=2.0)
    if sets == 2:
        second_set(engine)
    engine._doorbell = bell = Bell()
    for _ in range(3):
        engine._iteration()
    handle = engine.submit(allreduce("a"))
    engine._iteration()
    assert len(bell.waits) == 3                   # work was there: no wait at all
    np.testing.assert_array_equal(outcome(engine, handle), [1.0, 2.0, 3.0])
    engine._iteration()
    engine._iteration()
    assert bell.waits[3:] == pytest.approx([0.002, 0.004] if sets == 2 else [0.1, 0.1],
                                           rel=1e-9)


@pytest.mark.parametrize("work", ["queued", "pending", "backend busy", "shutdown"])
def test_each_kind_of_work_alone_keeps_the_engine_from_waiting(work: str) -> None:
    engine = set_up()
    engine._doorbell = bell = Bell()
    engine._wait_for_work()
    assert len(bell.waits) == 1                   # nothing to do: it waits
    if work == "queued":
        engine.submit(allreduce("a"))
    elif work == "pending":                       # submitted, waiting for agreement
        engine.submit(allreduce("a"))
        engine._drain_queue()
        assert not engine._queue
    elif work == "backend busy":
        engine.executor._after(Work(), lambda: None, None)
    else:
        engine.shutdown()
    engine._wait_for_work()
    assert len(bell.waits) == 1


def test_work_a_backend_finishes_later_completes_at_the_next_iteration() -> None:
    engine = set_up()
    handle = engine.handles.create()
    work = Work()
    engine.executor._after(work, lambda: engine.handles.complete(handle, "result"), None)
    assert engine._iteration()
    assert not engine.handles.poll(handle)
    work.finished = True
    assert engine._iteration()
    assert outcome(engine, handle) == "result"


# -- what the set-up decides ---------------------------------------------------------------
def test_with_a_report_the_engine_clocks_the_wait_for_agreement(tmp_path: Any) -> None:
    engine = set_up(report=str(tmp_path))
    engine.submit(allreduce("a"))
    assert engine._iteration()
    clock = engine.peer_wait
    assert clock is not None
    assert clock.since is None and clock.total > 0   # opened at submission, closed once agreed


def test_without_a_report_nothing_is_clocked() -> None:
    engine = set_up()
    engine.submit(allreduce("a"))
    assert engine._iteration() and engine.peer_wait is None


def test_rank_0_writes_the_timeline(tmp_path: Any) -> None:
    path = tmp_path / "timeline.json"
    engine = set_up(timeline=str(path))
    assert engine.timeline is not None
    engine.submit(allreduce("a"))
    assert engine._iteration()
    engine.shutdown()
    assert engine.timeline is None                # closed
    events = json.loads(path.read_text())
    rows = {e["args"]["name"]: e["pid"] for e in events if e.get("name") == "process_name"}
    ours = [(e["ph"], e.get("name")) for e in events
            if e["pid"] == rows["allreduce.a"] and e["ph"] != "M"]
    assert ours == [("X", "NEGOTIATE_ALLREDUCE"), ("B", "ALLREDUCE"), ("X", "QUEUE"),
                    ("X", "MEMCPY_IN_FUSION_BUFFER"), ("X", "MPI_ALLREDUCE"),
                    ("X", "MEMCPY_OUT_FUSION_BUFFER"), ("E", None)]
    assert "CYCLE_START" not in {e.get("name") for e in events}     # not asked for


def test_a_timeline_marking_cycles_marks_each_iteration(tmp_path: Any) -> None:
    path = tmp_path / "timeline.json"
    engine = set_up(timeline=str(path), timeline_mark_cycles=True)
    for _ in range(3):
        assert engine._iteration()
    engine.shutdown()
    events = json.loads(path.read_text())
    assert [e["ph"] for e in events if e.get("name") == "CYCLE_START"] == ["i"] * 3


def test_other_ranks_write_no_timeline(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    real = engine_module.detect
    monkeypatch.setattr(engine_module, "detect",
                        lambda comm: dataclasses.replace(real(comm), rank=1, size=2))
    engine = set_up(timeline=str(tmp_path / "timeline.json"))
    assert engine.topology.rank == 1
    assert engine.timeline is None and not (tmp_path / "timeline.json").exists()


@pytest.mark.parametrize("guard", [True, False])
def test_the_exit_guard_is_started_only_when_asked_for(guard: bool, world: SimpleNamespace) -> None:
    set_up(exit_guard=guard, peer_timeout=7.0)
    assert world.spawned == ([(os.environ, 7.0)] if guard else [])


def test_a_failed_set_up_is_raised_by_start(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_topology(comm: Any) -> Any:
        raise ValueError("no topology")

    monkeypatch.setattr(engine_module, "detect", no_topology)
    engine = engine_at_one_rank()
    escaped: list[BaseException] = []

    def watched() -> None:
        """The engine thread's body; an exception escaping it would leave start() waiting."""
        try:
            engine._main()
        except BaseException as exc:  # noqa: BLE001
            escaped.append(exc)
            engine._ready.set()

    engine._thread = threading.Thread(target=watched, daemon=True)
    with pytest.raises(HvdliteError) as raised:
        engine.start()
    assert escaped == []
    assert type(raised.value) is HvdliteError
    assert str(raised.value) == "hvdlite.init() failed: ValueError('no topology')"
    assert isinstance(raised.value.__cause__, ValueError)


# -- rounds: the fast path and full rounds ---------------------------------------------------
def test_a_collective_agreed_once_is_agreed_again_without_a_full_round(
        monkeypatch: pytest.MonkeyPatch) -> None:
    engine = set_up()
    rounds = FullRounds(engine, monkeypatch)
    engine.submit(allreduce("a"))
    assert engine._iteration()
    assert rounds.sets == [0]
    cache = engine.registry.member(0).cache
    version = cache.version
    for step in range(2):
        handle = engine.submit(allreduce("a", values=(step, step, step)))
        assert engine._iteration()
        np.testing.assert_array_equal(outcome(engine, handle), [step] * 3)
    assert rounds.sets == [0]                    # no second full round
    assert cache.version == version              # the fast path leaves every bit's meaning


def test_an_idle_engine_runs_no_full_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = set_up()
    second_set(engine)
    rounds = FullRounds(engine, monkeypatch)
    for _ in range(3):
        assert engine._iteration()
    assert rounds.sets == []


def test_each_pending_tensor_is_reported_with_how_long_it_has_waited(
        monkeypatch: pytest.MonkeyPatch) -> None:
    engine = set_up(stall_check_time=0)          # an hours-old request is no stall here
    rounds = FullRounds(engine, monkeypatch)
    request = allreduce("a")
    # Submitted when the clock read a third of now: an age that is not a remainder.
    request.submitted_at = time.monotonic() / 3
    engine.submit(request)
    before = time.monotonic() - request.submitted_at
    assert engine._iteration()
    ((set_id, report),) = rounds.sent
    ((desc, age),) = report.descs
    assert set_id == 0 and desc == request.desc and not report.shutdown
    assert before <= age <= time.monotonic() - request.submitted_at


def test_a_submission_rings_the_doorbell_unless_it_waits_in_a_batch() -> None:
    engine = set_up()
    engine._doorbell = bell = Bell()
    engine.submit(allreduce("alone"))
    assert bell.rings == 1                        # the engine wakes for it at once
    with engine.batch():
        engine.submit(allreduce("batched"))
        assert bell.rings == 1                    # the batch rings once, at its end


def test_a_failed_collective_does_not_hold_up_those_agreed_after_it() -> None:
    engine = set_up()
    bad = engine.submit(marker("bad", "dtype int8 is not supported"))
    good = engine.submit(allreduce("good"))
    assert engine._iteration()                    # both agreed in this one round, bad first
    error = outcome(engine, bad)
    assert isinstance(error, MismatchError) and str(error).startswith("rank 0: ")
    assert "dtype int8 is not supported" in str(error)
    np.testing.assert_array_equal(outcome(engine, good), [1.0, 2.0, 3.0])


def test_a_shutdown_asks_for_a_full_round_on_the_global_set_only() -> None:
    engine = set_up()
    other = second_set(engine)

    def words() -> list[int]:
        """Each set's NO_FULL_ROUND flag, or 0 where this rank needs a full round."""
        return [engine._round_vector(engine.registry.member(s))[0] & NO_FULL_ROUND
                for s in (0, other)]

    assert words() == [NO_FULL_ROUND, NO_FULL_ROUND]
    engine.shutdown()
    assert words() == [0, NO_FULL_ROUND]


def test_a_stall_error_held_behind_a_stuck_round_is_logged_once(log: Records) -> None:
    engine = set_up()
    engine._stall_messages[0] = "Stall: tensor 'a'."
    for _ in range(2):
        engine._while_waiting(0.0, 0.0)           # each tick of a round that does not complete
    assert [r.getMessage() for r in log.records] == [f"Stall: tensor 'a'. {stall.STUCK_ROUND_NOTE}"]
    del engine._stall_messages[0]                  # delivered by a full round
    engine._while_waiting(0.0, 0.0)
    engine._stall_messages[0] = "Stall: tensor 'b'."
    engine._while_waiting(0.0, 0.0)
    assert len(log.records) == 2 and log.records[1].getMessage().startswith("Stall: tensor 'b'.")


def test_a_reconfigured_stall_time_decides_when_a_cached_request_is_reported() -> None:
    """Stall inspection switched on by a negotiated reconfigure reaches the round vector:
    a cached request pending longer than a quarter of the new threshold asks for one full
    round, so the coordinator can see who is missing."""
    engine = set_up(stall_check_time=0.0, stall_shutdown_time=0.0)     # inspection off
    first = engine.submit(allreduce("a"))
    engine._iteration()                                  # agreed in a full round: cached
    np.testing.assert_array_equal(outcome(engine, first), [1.0, 2.0, 3.0])

    def flag_after(seconds_pending: float) -> int:
        request = allreduce("a")
        request.submitted_at -= seconds_pending
        engine.submit(request)
        engine._drain_queue()
        flag = engine._round_vector(engine.registry.member(0))[0] & NO_FULL_ROUND
        engine._iteration()
        assert engine.handles.poll(request.handle)
        engine.handles.wait(request.handle)
        return flag

    assert flag_after(10.0) == NO_FULL_ROUND             # nobody inspects: no report
    settings = (("stall_check_time", 4.0),)
    change = engine.submit(Request(Descriptor("reconfigure.0", Kind.RECONFIGURE,
                                              settings=settings), 0))
    engine._iteration()
    assert outcome(engine, change) is None and engine.config.stall_check_time == 4.0
    assert flag_after(0.5) == NO_FULL_ROUND               # under a quarter of 4 s
    assert flag_after(2.0) == 0                           # over it: reported once
