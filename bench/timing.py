"""The one timing loop every benchmark uses, so all figures are taken alike."""
from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np

from bench.world import slowest as _slowest


def seconds_per_call(step: Callable[[], None], seconds: float, comm: Any,
                     warmup: int = 3, min_calls: int = 5) -> float:
    """Mean seconds per ``step()`` on the slowest rank.

    Runs ``warmup`` untimed calls, times one call on rank 0 to choose an iteration
    count filling about ``seconds`` (agreed by all ranks, since ``step`` may be
    collective), then times that many calls between barriers.
    """
    for _ in range(warmup):
        step()
    comm.Barrier()
    start = time.perf_counter()
    step()
    probe = comm.bcast(time.perf_counter() - start, root=0)
    calls = max(min_calls, min(20000, int(seconds / max(probe, 1e-7))))
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(calls):
        step()
    elapsed = (time.perf_counter() - start) / calls
    return max(comm.allgather(elapsed))    # on an MPI or a torch communicator alike


def lone_median(comm: Any, op: Callable[[], object], repeats: int, idle_s: float) -> float:
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
    _slowest(comm, slowest)
    return float(np.median(slowest))
