"""The floors under what hvdlite does where one thread talks to MPI (its engine):
the same work with only what that design cannot do without, and no other hvdlite code.

A user thread that hands an allreduce to another thread and waits for it pays for two
wake-ups besides the MPI call (``Helper``: the caller wakes the helper by releasing a
lock and the helper wakes the caller the same way, the cheapest hand-off Python has).
hvdlite also agrees on what is reduced before any rank reduces, which is what turns a
mismatch between ranks into an error instead of a hang (``Agreement``: one bitwise-AND
round as wide as the engine's, started as it starts its round, hvdlite's own ``Round``:
MPI-4's persistent allreduce where the library has it).

- The lone op (``bench allreduce``): ``handoff_floor`` is the raw 4-byte allreduce run
  by a helper thread; ``negotiated_floor`` agrees first. A lone-op target below them
  cannot be met by the design; the rest of hvdlite's lone op is its own Python.
- A training step (``bench training``'s fused_handoff and fused_negotiated): the
  hand-fused loop's one flat Allreduce run by a ``Helper``, and after an ``Agreement``
  waited for as the engine waits while a user thread is blocked. What hvdlite's step
  costs beyond fused_negotiated is its own; what fused_negotiated costs beyond the
  hand-fused loop is the design's.
"""
from __future__ import annotations

import math
import threading
import time
from typing import Callable

import numpy as np
from mpi4py import MPI

from bench.timing import lone_median
from hvdlite.config import Config
from hvdlite.failure import waiting
from hvdlite.negotiation.cache import ResponseCache
from hvdlite.negotiation.process_sets import Round
from hvdlite.transport.mpi_transport import MpiTransport

_DEFAULTS = Config()
# hvdlite's negotiation round at the default HVDLITE_CACHE_CAPACITY: a flag word and the
# cache's bit vector, as the engine builds it (hvdlite.negotiation.process_sets.round_vector).
ROUND_WORDS = 1 + ResponseCache(_DEFAULTS.cache_capacity).words


class Helper:
    """A thread that runs ``work`` each time the caller hands over, while the caller
    waits; ``close`` stops it."""

    def __init__(self, work: Callable[[], object]) -> None:
        self._work = work
        self._wake, self._finished = threading.Lock(), threading.Lock()
        self._wake.acquire()
        self._finished.acquire()
        self._stop = False
        self._thread = threading.Thread(target=self._serve, name="floor-helper", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            self._wake.acquire()
            if self._stop:
                return
            self._work()
            self._finished.release()

    def run(self) -> None:
        self._wake.release()
        self._finished.acquire()

    def close(self) -> None:
        self._stop = True
        self._wake.release()
        self._thread.join()


class Agreement:
    """One negotiation round over ``comm`` (made and freed at a collective point on
    every rank), polled until done: a spin of ``spin_s`` (HVDLITE_SPIN_TIME's default:
    the engine's while a user thread waits; ``math.inf``: spin throughout), then the
    engine's sleeps (hvdlite.failure.waiting), growing from 20 us to a quarter of the
    default cycle."""

    def __init__(self, comm: MPI.Comm, words: int = ROUND_WORDS,
                 spin_s: float = _DEFAULTS.spin_time * 1e-6) -> None:
        self._round = Round(MpiTransport(comm), words)
        self._spin_s = spin_s
        self._longest_pause = waiting.longest_pause(_DEFAULTS.cycle_time)

    def run(self) -> None:
        self._round.cleared()[0] = 1
        request = self._round.start()
        started, pause = time.perf_counter(), waiting.FIRST_PAUSE_S
        while not request.Test():
            if time.perf_counter() - started > self._spin_s:
                time.sleep(pause)
                pause = min(2 * pause, self._longest_pause)

    def free(self) -> None:
        """Before ``comm`` is freed (the round's request refers to it)."""
        self._round.free()


def handoff_floor(comm: MPI.Comm, repeats: int, idle_s: float) -> float:
    """``lone_median`` of a 4-byte allreduce that a helper thread runs for the caller."""
    tiny = np.zeros(1, dtype=np.float32)
    return _helped_median(comm, lambda private: private.Allreduce(
        MPI.IN_PLACE, tiny, op=MPI.SUM), repeats, idle_s)


def negotiated_floor(comm: MPI.Comm, repeats: int, idle_s: float,
                     round_words: int = ROUND_WORDS) -> float:
    """``lone_median`` of the least a negotiated lone op does: the helper thread first
    agrees in one round of ``round_words`` words (as wide as hvdlite's at the default
    cache capacity), spinning until it is done, and only then runs the 4-byte
    allreduce. What is above this in hvdlite's lone op is its own Python."""
    tiny = np.zeros(1, dtype=np.float32)
    agreements: list[Agreement] = []    # made at the first hand-off: a collective point

    def agree_then_reduce(private: MPI.Comm) -> None:
        if not agreements:
            agreements.append(Agreement(private, round_words, spin_s=math.inf))
        agreements[0].run()
        private.Allreduce(MPI.IN_PLACE, tiny, op=MPI.SUM)

    def free_agreement() -> None:
        for agreement in agreements:
            agreement.free()
    return _helped_median(comm, agree_then_reduce, repeats, idle_s, free_agreement)


def _helped_median(comm: MPI.Comm, work: Callable[[MPI.Comm], object], repeats: int,
                   idle_s: float, before_free: Callable[[], None] = lambda: None) -> float:
    """``lone_median`` of handing ``work`` (on a private communicator) to a ``Helper``.
    ``before_free`` releases what ``work`` made on the communicator."""
    private = comm.Dup()
    helper = Helper(lambda: work(private))
    try:
        return lone_median(comm, helper.run, repeats, idle_s)
    finally:
        helper.close()
        before_free()
        private.Free()
