"""The engine in one process, at one rank (tests/unit/engine_rig.py): how it stops:
after an agreed shutdown or stall, at shutdown() from any thread or at exit, and
when it crashes.
Most tests drive a set-up engine's iterations from the test thread; the few
about its own thread start it for real. What the engine would do to the process
or the job (os._exit, MPI_Abort, the exit guard, marking the world broken) is
recorded instead (the ``world`` fixture)."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from mpi4py import MPI

from hvdlite.config import Config
from hvdlite.engine import stopping
from hvdlite.engine.engine import Engine
from hvdlite.errors import HvdliteError, PeerLostError, ShutdownError, StallError
from hvdlite.failure import liveness
from hvdlite.negotiation.coordinator import Report
from tests.unit import engine_rig
from tests.unit.engine_rig import (QUIET, FullRounds, Records, allreduce, engine_at_one_rank,
                                   outcome, rank_3_world, second_set, set_up)

pytestmark = pytest.mark.timeout(60)
world, log = engine_rig.world, engine_rig.log   # fixtures


# -- after an agreed shutdown or stall ----------------------------------------------------------
def test_once_a_shutdown_is_agreed_no_other_set_runs_a_round(
        monkeypatch: pytest.MonkeyPatch) -> None:
    engine = set_up()
    other = second_set(engine)
    rounds = FullRounds(engine, monkeypatch)
    handle = engine.submit(allreduce("x", other))   # new on that set: it needs a full round
    engine.shutdown()
    assert not engine._iteration()
    assert rounds.sets == [0] and rounds.sent[0][1].shutdown
    error = outcome(engine, handle)
    assert isinstance(error, ShutdownError) and "shut down on rank(s) [0]" in str(error)


def test_once_a_stall_error_is_agreed_no_other_set_runs_a_round(
        monkeypatch: pytest.MonkeyPatch) -> None:
    engine = set_up()
    other = second_set(engine)
    rounds = FullRounds(engine, monkeypatch)
    handle = engine.submit(allreduce("x", other))
    message = "Stall: for 9.0 s ranks [0] have been waiting on tensor 'y'."
    engine._stall_messages[0] = message           # held by the inspector for a full round
    assert not engine._iteration()
    assert rounds.sets == [0]
    error = outcome(engine, handle)
    assert isinstance(error, StallError) and str(error) == message
    assert isinstance(engine.dead, StallError)


def test_a_full_round_of_another_set_never_carries_the_shutdown(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """shutdown() may come between the global set's round and another set's, in one
    iteration: that set's round goes on; the global set's next round stops."""
    engine = set_up()
    other = second_set(engine)
    rounds = FullRounds(engine, monkeypatch)
    engine.shutdown()
    assert engine._full_round(engine.registry.member(other))
    assert rounds.sent == [(other, Report([], False))] and engine.dead is None


# -- stopping ---------------------------------------------------------------------------------
def test_stopping_fails_every_queued_and_pending_request_on_every_set() -> None:
    engine = set_up()
    other = second_set(engine)
    handles = [engine.submit(allreduce("p0")), engine.submit(allreduce("p1", other))]
    engine._drain_queue()                          # these two are pending, on two sets
    handles += [engine.submit(allreduce("q0")), engine.submit(allreduce("q1", other))]
    error = ShutdownError("stopped")
    engine._stop(error)
    assert [outcome(engine, h) for h in handles] == [error] * 4
    assert not engine._queue and not any(s.pending for s in engine.registry.members())
    assert engine._in_flight == {0: set(), other: set()}   # nothing left in flight
    assert engine.dead is error
    engine._stop(error)                            # again, with nothing queued: harmless


def test_a_shut_down_engine_says_why_it_is_dead() -> None:
    engine = set_up()
    assert engine.dead is None
    handle = engine.submit(allreduce("a"))
    engine.shutdown()
    assert not engine._iteration()
    assert isinstance(engine.dead, ShutdownError)
    # What the round that carried the shutdown agreed still ran.
    np.testing.assert_array_equal(outcome(engine, handle), [1.0, 2.0, 3.0])
    with pytest.raises(ShutdownError, match="shut down on rank"):
        engine.submit(allreduce("b"))


def test_shutdown_waits_for_the_engine_thread_to_end() -> None:
    engine = engine_at_one_rank()
    engine.start()
    thread, joins = engine._thread, []
    real_join = thread.join
    thread.join = lambda timeout=None: (joins.append(timeout), real_join(timeout))[1]
    engine.shutdown(timeout=60.0)
    assert joins == [60.0] and not thread.is_alive()
    assert isinstance(engine.dead, ShutdownError)


def test_shutdown_from_the_engine_thread_itself_does_not_wait_for_itself() -> None:
    engine = set_up()
    raised: list[BaseException] = []

    def on_the_engine_thread() -> None:
        try:
            engine.shutdown(timeout=60.0)
        except BaseException as exc:  # noqa: BLE001
            raised.append(exc)

    engine._thread = threading.Thread(target=on_the_engine_thread, daemon=True)
    engine._thread.start()
    engine._thread.join(30)
    assert raised == []
    assert not engine._iteration() and isinstance(engine.dead, ShutdownError)


def test_an_engine_stuck_past_the_timeout_is_reported(world: SimpleNamespace,
                                                      log: Records) -> None:
    engine = set_up()
    joins: list[float] = []
    engine._thread = SimpleNamespace(is_alive=lambda: True, join=joins.append)   # stuck in MPI
    engine.shutdown(timeout=2.0)
    assert joins == [2.0]
    assert "did not stop within 2 s" in log.text
    assert world.broken == [(0, 1, "the hvdlite engine is stuck inside MPI")]


@pytest.mark.parametrize("exiting, dead, expected", [
    (False, False, []),
    (True, False, ["abort_if_exiting_with_error", "abort_if_broken"]),
    (True, True, ["abort_if_broken"]),
])
def test_shutdown_at_interpreter_exit_hands_over_to_the_failure_hooks(
        exiting: bool, dead: bool, expected: list[str], world: SimpleNamespace,
        monkeypatch: pytest.MonkeyPatch) -> None:
    engine = set_up()
    if dead:
        engine._stop(ShutdownError("a peer shut down"))
    main = SimpleNamespace(is_alive=lambda: not exiting)   # atexit: the main thread has ended
    monkeypatch.setattr(stopping, "threading", SimpleNamespace(
        main_thread=lambda: main, current_thread=threading.current_thread))
    engine.shutdown()
    assert world.calls == expected


# -- crashing ---------------------------------------------------------------------------------
def test_an_engine_that_fails_stops_with_an_error_naming_its_rank(
        monkeypatch: pytest.MonkeyPatch, world: SimpleNamespace, log: Records) -> None:
    engine = engine_at_one_rank()
    engine.start()

    def broken(*args: Any) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(engine.executor, "run", broken)
    handle = engine.submit(allreduce("a"))
    engine._thread.join(30)
    assert not engine._thread.is_alive()
    error = outcome(engine, handle)
    assert type(error) is HvdliteError
    assert str(error) == "hvdlite engine failed on rank 0: RuntimeError('boom')"
    assert "hvdlite engine failed on rank 0; this is a bug" in log.text
    assert "RuntimeError: boom" in log.text        # the traceback
    with pytest.raises(HvdliteError, match="failed on rank 0"):
        engine.submit(allreduce("b"))
    assert world.ends == [] and engine.transport.comm.__dict__.get("ends", []) == []


def test_a_crash_with_abort_on_error_aborts_the_job_with_status_1(world: SimpleNamespace) -> None:
    engine = Engine(Config(**{**QUIET, "abort_on_error": True}), rank_3_world(world))
    handle = engine.submit(allreduce("a"))
    engine._crash(RuntimeError("boom"))
    assert world.ends == [("Abort", 1), ("_exit", 1)]
    assert str(outcome(engine, handle)) == "hvdlite engine failed on rank 3: RuntimeError('boom')"


def test_a_crash_without_abort_on_error_leaves_the_process_alone(world: SimpleNamespace,
                                                                  log: Records) -> None:
    engine = Engine(Config(**QUIET), rank_3_world(world))
    engine._crash(RuntimeError("boom"))
    assert world.ends == []
    assert str(engine.dead) == "hvdlite engine failed on rank 3: RuntimeError('boom')"
    assert "hvdlite engine failed on rank 3; this is a bug" in log.text


def test_a_lost_peer_unwinding_the_engine_is_not_a_crash(world: SimpleNamespace,
                                                        log: Records) -> None:
    """_lost already failed everything with PeerLostError before it unwound."""
    engine = Engine(Config(**{**QUIET, "abort_on_error": True}), rank_3_world(world))
    handle = engine.submit(allreduce("a"))
    engine._crash(liveness.RoundAbandoned("rank 1 exited"))
    assert engine.dead is None and not engine.handles.poll(handle)
    assert world.ends == [] and log.records == []


# -- a peer lost while the engine is inside a data collective (sentinel.py) --------------------
LOST = "rank 0: lost a peer: rank 1 (pid 4242 on vm) exited. ..."


def test_the_engine_tells_the_sentinel_while_it_runs_a_collective(
        monkeypatch: pytest.MonkeyPatch) -> None:
    engine = set_up()
    seen: list[Any] = []
    run = engine.executor.run
    monkeypatch.setattr(engine.executor, "run", lambda *args: (
        seen.append(engine._sentinel.inside), run(*args))[1])
    handle = engine.submit(allreduce("a"))
    engine._iteration()
    outcome(engine, handle)
    since, ranks = seen[0]
    assert ranks == (0,) and 0 < since <= time.monotonic()
    assert engine._sentinel.inside is None                 # not inside one any more


def test_the_sentinels_verdict_says_so_fails_everything_and_later_errors_stay_quiet(
        world: SimpleNamespace, log: Records, capfd: pytest.CaptureFixture) -> None:
    engine = set_up(abort_on_error=True)
    handle = engine.submit(allreduce("a"))
    engine._lost(LOST)                                     # as the sentinel's thread calls it
    error = outcome(engine, handle)
    assert isinstance(error, PeerLostError) and str(error) == LOST
    assert world.broken == [(0, 1, LOST)]
    assert capfd.readouterr().err.endswith(f"PeerLostError: {LOST}\n")   # said at once
    engine._lost("rank 0: lost a peer: rank 1 again")     # the engine's own check, later
    engine._crash(MPI.Exception(MPI.ERR_OTHER))           # the stuck MPI call failing at last
    assert capfd.readouterr().err == "" and log.records == []
    assert world.broken == [(0, 1, LOST)] and world.ends == []


def test_an_mpi_error_from_a_peers_death_is_a_lost_peer_not_a_bug(
        world: SimpleNamespace, log: Records, monkeypatch: pytest.MonkeyPatch) -> None:
    """E.g. MPICH's process_vm_readv failing with ESRCH: the peer's memory is gone."""
    engine = set_up(abort_on_error=True)
    monkeypatch.setattr(engine._sentinel, "explain", lambda: LOST)
    handle = engine.submit(allreduce("a"))
    engine._crash(MPI.Exception(MPI.ERR_OTHER))
    assert str(outcome(engine, handle)) == LOST and isinstance(engine.dead, PeerLostError)
    assert world.broken == [(0, 1, LOST)] and world.ends == [] and log.records == []


def test_an_mpi_error_with_every_peer_alive_is_still_a_crash(
        world: SimpleNamespace, log: Records, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = set_up()
    monkeypatch.setattr(engine._sentinel, "explain", lambda: None)
    engine._crash(MPI.Exception(MPI.ERR_OTHER))
    assert str(engine.dead).startswith("hvdlite engine failed on rank 0: ")
    assert "this is a bug" in log.text and world.broken == []


def test_shutdown_after_a_lost_peer_does_not_wait_for_a_thread_stuck_in_mpi(
        world: SimpleNamespace, log: Records) -> None:
    engine = set_up()
    joins: list[float] = []
    engine._thread = SimpleNamespace(is_alive=lambda: True, join=joins.append)
    engine._lost(LOST)
    engine.shutdown(timeout=30.0)
    assert joins == [] and "did not stop" not in log.text
