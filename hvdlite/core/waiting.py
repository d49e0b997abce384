"""How the engine waits for a negotiation round: the spin/sleep schedule, and the
liveness tick that runs while a wait lasts.

A waiting engine busy-polls only while a user thread is blocked in
``synchronize()`` (that is latency someone is waiting on); otherwise it sleeps
in growing pauses, leaving the CPU to training, which on a core per rank would
lose whatever a spinning engine takes.
"""
from __future__ import annotations

import ctypes
import time
from typing import Any, Callable, Sequence

from mpi4py import MPI

from hvdlite.core import liveness

_PR_SET_TIMERSLACK = 29
# The wait schedule: spin in slices short enough to notice completion within a
# few microseconds, and sleep in pauses that start at 20 us (the latency of a
# wake-up on this kind of VM) and double up to a quarter of the idle cycle.
_SPIN_SLICE_S = 20e-6
_FIRST_PAUSE_S = 20e-6
_LONGEST_PAUSE_FLOOR_S = 50e-6


def precise_sleeps() -> None:
    """Linux pads every sleep of this thread by its timer slack (50 us by default),
    which made each short pause in a wait cost ~80 us. Ask for 1 us instead."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_TIMERSLACK, ctypes.c_ulong(1000), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: sleeps are merely less precise
        pass


class RoundWaiter:
    """Waits on MPI requests; ``on_tick(started, now)`` runs every liveness.TICK_S
    once a wait has lasted (the stall inspector, the check for a lost peer)."""

    def __init__(self, config: Any, handles: Any, on_tick: Callable[[float, float], None]) -> None:
        self.config = config      # replaced by a negotiated reconfiguration
        self._handles = handles
        self._on_tick = on_tick

    def wait(self, requests: Sequence[MPI.Request]) -> None:
        """Poll until every round completes, sleeping in growing pauses. While a user
        thread is blocked in synchronize() the engine busy-polls instead (Testall
        releases the GIL), for up to HVDLITE_SPIN_TIME per round: that is latency
        someone is waiting on. Otherwise the CPU belongs to the training thread,
        which on a core per rank would lose whatever a spinning engine takes.
        A wait that lasts runs on_tick every liveness.TICK_S: the stall
        inspector, and the check that fails everything if a peer is gone."""
        requests = list(requests)
        budget = self.config.spin_time * 1e-6
        pause = _FIRST_PAUSE_S
        longest = max(_LONGEST_PAUSE_FLOOR_S, self.config.cycle_time * 1e-3 / 4)
        started = next_tick = 0.0
        while not MPI.Request.Testall(requests):
            if self._handles.waiting and budget > 0:
                start = time.perf_counter()
                while time.perf_counter() - start < _SPIN_SLICE_S:
                    if MPI.Request.Testall(requests):
                        return
                budget -= time.perf_counter() - start
                continue
            time.sleep(pause)
            if pause < longest:
                pause = min(pause * 2, longest)
                continue
            # Only a wait that reached the longest pause (about 0.3 ms in) reads the
            # clock: rounds that complete sooner pay nothing for what follows.
            now = time.monotonic()
            if not started:
                started, next_tick = now, now + liveness.TICK_S
            elif now >= next_tick:
                self._on_tick(started, now)
                next_tick = now + liveness.TICK_S
