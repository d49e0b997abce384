"""The floor under a lone op where one thread talks to MPI (hvdlite's engine).

A user thread that hands an allreduce to another thread and waits for it pays for
two wake-ups besides the MPI call. ``handoff_floor`` measures exactly that, with
no hvdlite code: the raw 4-byte allreduce of the lone-op figure, run by a helper
thread that the caller wakes by releasing a lock and that wakes the caller the
same way (the cheapest hand-off Python has). hvdlite's lone op adds a negotiation
round and its Python to this; a target below it cannot be met by the design.
``negotiated_floor`` adds the round: one agreement allreduce before the data, started
as hvdlite starts its round (``Round``, MPI-4's persistent allreduce where the library
has it) and nothing else of hvdlite, so the rest of hvdlite's lone op is its own Python.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

import numpy as np
from mpi4py import MPI

from hvdlite.bench.timing import lone_median
from hvdlite.config import Config
from hvdlite.core.cache import ResponseCache
from hvdlite.core.registry import Round
from hvdlite.core.transport_mpi import MpiTransport

# hvdlite's negotiation round at the default HVDLITE_CACHE_CAPACITY: a flag word and the
# cache's bit vector, as the engine builds it (hvdlite.core.registry.round_vector).
ROUND_WORDS = 1 + ResponseCache(Config().cache_capacity).words


def handoff_floor(comm: MPI.Comm, repeats: int, idle_s: float) -> float:
    """``lone_median`` of a 4-byte allreduce that a helper thread runs for the caller."""
    tiny = np.zeros(1, dtype=np.float32)
    return _helped_median(comm, lambda private: private.Allreduce(
        MPI.IN_PLACE, tiny, op=MPI.SUM), repeats, idle_s)


def negotiated_floor(comm: MPI.Comm, repeats: int, idle_s: float,
                     round_words: int = ROUND_WORDS) -> float:
    """``lone_median`` of the least a negotiated lone op does: the helper thread first
    agrees in one bitwise-AND allreduce of ``round_words`` words (as wide as hvdlite's
    round at the default cache capacity), started as hvdlite's engine starts its round
    (hvdlite's own ``Round``) and polled until done, and only then runs the 4-byte
    allreduce. What is above this in hvdlite's lone op is its own Python."""
    tiny = np.zeros(1, dtype=np.float32)
    rounds: list[Round] = []     # made at the first hand-off: a collective point everywhere

    def agree_then_reduce(private: MPI.Comm) -> None:
        if not rounds:
            rounds.append(Round(MpiTransport(private), round_words))
        rounds[0].cleared()[0] = 1
        request = rounds[0].start()
        while not request.Test():
            pass
        private.Allreduce(MPI.IN_PLACE, tiny, op=MPI.SUM)

    def free_round() -> None:
        for round_ in rounds:
            round_.free()
    return _helped_median(comm, agree_then_reduce, repeats, idle_s, free_round)


def _helped_median(comm: MPI.Comm, work: Callable[[MPI.Comm], object], repeats: int,
                   idle_s: float, before_free: Callable[[], None] = lambda: None) -> float:
    """``lone_median`` of handing ``work`` (on a private communicator) to a helper
    thread that the caller wakes by releasing a lock and that wakes the caller the same
    way, the cheapest hand-off Python has. ``before_free`` releases what ``work`` made
    on the communicator."""
    private = comm.Dup()
    wake, finished = threading.Lock(), threading.Lock()
    wake.acquire()
    finished.acquire()
    stop = []

    def helper() -> None:
        while True:
            wake.acquire()
            if stop:
                return
            work(private)
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
        before_free()
        private.Free()
