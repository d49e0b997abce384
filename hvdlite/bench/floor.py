"""The floor under a lone op where one thread talks to MPI (hvdlite's engine).

A user thread that hands an allreduce to another thread and waits for it pays for
two wake-ups besides the MPI call. ``handoff_floor`` measures exactly that, with
no hvdlite code: the raw 4-byte allreduce of the lone-op figure, run by a helper
thread that the caller wakes by releasing a lock and that wakes the caller the
same way (the cheapest hand-off Python has). hvdlite's lone op adds a negotiation
round and its Python to this; a target below it cannot be met by the design.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

import numpy as np
from mpi4py import MPI


def lone_median(comm: MPI.Comm, op: Callable[[], object], repeats: int,
                idle_s: float) -> float:
    """Median over ``repeats`` of the slowest rank's time for ``op`` issued right
    after a barrier that follows ``idle_s`` seconds of sleep."""
    times = []
    for _ in range(repeats):
        time.sleep(idle_s)
        comm.Barrier()
        start = time.perf_counter()
        op()
        times.append(time.perf_counter() - start)
    slowest = np.array(times)
    comm.Allreduce(MPI.IN_PLACE, slowest, op=MPI.MAX)
    return float(np.median(slowest))


def handoff_floor(comm: MPI.Comm, repeats: int, idle_s: float) -> float:
    """``lone_median`` of a 4-byte allreduce that a helper thread runs for the caller."""
    private = comm.Dup()
    wake, finished = threading.Lock(), threading.Lock()
    wake.acquire()
    finished.acquire()
    tiny = np.zeros(1, dtype=np.float32)
    stop = []

    def helper() -> None:
        while True:
            wake.acquire()
            if stop:
                return
            private.Allreduce(MPI.IN_PLACE, tiny, op=MPI.SUM)
            finished.release()

    thread = threading.Thread(target=helper, name="floor-helper", daemon=True)
    thread.start()

    def handed_off() -> None:
        wake.release()
        finished.acquire()
    try:
        return lone_median(comm, handed_off, repeats, idle_s)
    finally:
        stop.append(True)
        wake.release()
        thread.join()
        private.Free()
