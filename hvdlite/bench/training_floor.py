"""The floor under a negotiated training step: the hand-fused loop (backward, one flat
Allreduce, step) with only what a Horovod-style engine cannot do without.

hvdlite turns a mismatch between ranks into an error instead of a hang because no rank
reduces before every rank has agreed, in a negotiation round, on what is reduced; and
one thread talks to MPI, so the training thread hands the reduction over and waits.
``fused_handoff`` is the hand-fused loop whose Allreduce a helper thread runs (woken
as cheaply as Python allows, as ``floor.py``'s lone-op floor); ``fused_negotiated``
also agrees first, in one bitwise-AND round as wide as hvdlite's (hvdlite's own
``Round``), waited for as hvdlite waits. Neither runs any other hvdlite code, so what
hvdlite's training step costs beyond ``fused_negotiated`` is its own; what
``fused_negotiated`` costs beyond ``hand_fused`` is the design's.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

from hvdlite.bench.floor import ROUND_WORDS


class Helper:
    """A thread that runs ``work`` each time the caller hands over, while the caller
    waits (two locks: the cheapest hand-off Python has)."""

    def __init__(self, work: Callable[[], None]) -> None:
        self._work = work
        self._wake, self._finished = threading.Lock(), threading.Lock()
        self._wake.acquire()
        self._finished.acquire()
        self._stop = False
        self.cpu = 0.0            # the helper's thread CPU inside work
        self._thread = threading.Thread(target=self._serve, name="floor-helper", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            self._wake.acquire()
            if self._stop:
                return
            started = time.thread_time()
            self._work()
            self.cpu += time.thread_time() - started
            self._finished.release()

    def run(self) -> None:
        self._wake.release()
        self._finished.acquire()

    def close(self) -> None:
        self._stop = True
        self._wake.release()
        self._thread.join()


class Agreement:
    """One negotiation round as hvdlite's engine runs it: hvdlite's ``Round`` over a
    private communicator (a collective point where it is made and freed), started and
    polled as the engine polls while a user thread waits: a spin of HVDLITE_SPIN_TIME,
    then sleeps growing from 20 us to a quarter of the 1 ms cycle."""

    def __init__(self, comm: Any) -> None:
        from hvdlite.config import Config
        from hvdlite.core.registry import Round
        from hvdlite.core.transport_mpi import MpiTransport
        self._round = Round(MpiTransport(comm), ROUND_WORDS)
        self._spin_s = Config().spin_time * 1e-6

    def run(self) -> None:
        self._round.cleared()[0] = 1
        request = self._round.start()
        started, pause = time.perf_counter(), 20e-6
        while not request.Test():
            if time.perf_counter() - started > self._spin_s:
                time.sleep(pause)
                pause = min(2 * pause, 250e-6)

    def free(self) -> None:
        self._round.free()
