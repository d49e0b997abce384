"""A real Engine at one rank in the test process, for tests/unit/test_engine.py.

MPI starts as a singleton without mpiexec; each engine gets its own duplicate
of COMM_SELF, so one test's rounds never meet another's. ``set_up`` runs the
engine's set-up on the calling thread and never starts its thread: the test
then steps it one iteration at a time (``engine._iteration()``), which at one
rank completes every round at once, so nothing needs a sleep to line up.

The fixtures ``world`` (autouse) and ``log`` are taken into a test module by
assignment (``world = engine_rig.world``).
"""
from __future__ import annotations

import logging
import os
from types import SimpleNamespace
from typing import Any, Callable, Iterator, Optional

import numpy as np
import pytest
from mpi4py import MPI

from hvdlite.config import Config
from hvdlite.engine import stopping
from hvdlite.engine.engine import Engine
from hvdlite.failure import exit_guard, abort_on_error
from hvdlite.negotiation.coordinator import Report
from hvdlite.negotiation.requests import Descriptor, Kind, Request
from hvdlite.transport.mpi_transport import MpiTransport

# Short idle waits; nothing outside the test process (no exit guard, no abort).
QUIET = dict(cycle_time=1.0, exit_guard=False, abort_on_error=False)


class SafeComm(MPI.Intracomm):
    """This process's one-rank world, whose MPI_Abort is recorded instead of ending
    the test run (a mutant of the engine's crash path may call it)."""

    def Abort(self, errorcode: int = 0) -> None:  # noqa: N802 (mpi4py's name)
        self.__dict__.setdefault("ends", []).append(("Abort", errorcode))


def engine_at_one_rank(idle_tick_s: Optional[float] = None, **settings: Any) -> Engine:
    """An engine not yet started, over a private one-rank communicator (whose idle
    tick is ``idle_tick_s`` if given, as another transport's would be)."""
    transport = MpiTransport(SafeComm(MPI.COMM_SELF.Dup()))
    if idle_tick_s is not None:
        transport.idle_tick_s = idle_tick_s
    return Engine(Config(**{**QUIET, **settings}), transport)


def set_up(idle_tick_s: Optional[float] = None, **settings: Any) -> Engine:
    """An engine set up on this thread whose own thread never runs: the test drives it."""
    engine = engine_at_one_rank(idle_tick_s, **settings)
    engine._setup()
    return engine


def second_set(engine: Engine) -> int:
    """Register the process set {0} besides the global one (what an agreed
    add_process_set does, collectively over the global set)."""
    return engine.registry.add((0,), engine.registry.member(0).comm)


def allreduce(name: str, set_id: int = 0, values: tuple[float, ...] = (1.0, 2.0, 3.0)) -> Request:
    array = np.asarray(values, dtype=np.float32)
    desc = Descriptor(name, Kind.ALLREDUCE, "float32", array.shape)
    return Request(desc, set_id, array, np.empty_like(array))


def marker(name: str, reason: str, set_id: int = 0) -> Request:
    """What a rank submits when its own arguments were invalid (api/submission.py)."""
    return Request(Descriptor(name, Kind.ALLREDUCE, error=reason), set_id)


def outcome(engine: Engine, handle: int) -> Any:
    """A finished handle's result, or its error (raised errors are returned)."""
    assert engine.handles.poll(handle), "the handle is not finished"
    try:
        return engine.handles.wait(handle)
    except BaseException as exc:  # noqa: BLE001 (the error is the outcome)
        return exc


class Bell:
    """Stands in for the doorbell: records each idle wait's timeout and asks
    ``ready()`` as the real one does, without sleeping."""

    def __init__(self) -> None:
        self.waits: list[float] = []
        self.ready_answers: list[bool] = []
        self.rings = 0

    def listen(self, timeout: float, ready: Callable[[], bool]) -> bool:
        self.waits.append(timeout)
        self.ready_answers.append(ready())
        return self.ready_answers[-1]

    def ring(self) -> None:
        self.rings += 1

    def ring_always(self) -> None:
        pass


class FullRounds:
    """Spies on full rounds: the set of each gather and the report this rank sent."""

    def __init__(self, engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sent: list[tuple[int, Report]] = []
        real = MpiTransport.gather_awaited

        def gather(comm: MpiTransport, report: Report, wait: Any) -> Optional[list[Any]]:
            set_id = next(s.set_id for s in engine.registry.members() if s.comm is comm)
            self.sent.append((set_id, report))
            return real(comm, report, wait)

        monkeypatch.setattr(MpiTransport, "gather_awaited", gather)

    @property
    def sets(self) -> list[int]:
        return [set_id for set_id, _ in self.sent]


class Work:
    """A backend's asynchronous work, finished when the test says so."""

    def __init__(self) -> None:
        self.finished = False

    def done(self) -> bool:
        return self.finished

    def wait(self) -> None:
        self.finished = True


@pytest.fixture(autouse=True)
def world(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """What the engine does to the process and the job, recorded instead of done: a
    mutant of its crash path must not end the test run, nor marking the world broken
    register the exit hook that would abort it at the end."""
    seen = SimpleNamespace(ends=[], calls=[], broken=[], spawned=[])

    class Os:
        """The ``os`` of the engine's crash path (stopping.py), whose _exit is recorded."""
        def __getattr__(self, name: str) -> Any:
            return getattr(os, name)

        def _exit(self, status: int) -> None:
            seen.ends.append(("_exit", status))

    monkeypatch.setattr(stopping, "os", Os())
    monkeypatch.setattr(abort_on_error, "ABORT_GRACE_S", 0.0)
    monkeypatch.setattr(abort_on_error, "mark_broken", lambda *args: seen.broken.append(args))
    for name in ("abort_if_broken", "abort_if_exiting_with_error"):
        monkeypatch.setattr(abort_on_error, name, lambda name=name: seen.calls.append(name))
    monkeypatch.setattr(exit_guard, "spawn", lambda *args: seen.spawned.append(args))
    return seen


class Records(logging.Handler):
    """Keeps the records it handles."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    @property
    def text(self) -> str:
        return "\n".join(self.format(r) for r in self.records)


@pytest.fixture
def log() -> Iterator[Records]:
    """The 'hvdlite' logger's records at WARNING and above (it may not propagate)."""
    logger, handler = logging.getLogger("hvdlite"), Records()
    level = logger.level
    logger.setLevel(logging.WARNING)
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


def rank_3_world(world: SimpleNamespace) -> SimpleNamespace:
    """A transport stand-in for an engine that is never set up: rank 3, whose abort
    (MPI_Abort) is recorded."""
    return SimpleNamespace(rank=3, failures=(MPI.Exception,), idle_tick_s=0.1,
                           abort=lambda code: world.ends.append(("Abort", code)))
