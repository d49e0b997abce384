"""The one timing loop every benchmark uses, so all figures are taken alike, and a
training method's timed loop with its CPU per thread (``Measured``)."""
from __future__ import annotations

import time
from typing import Any, Callable, Optional

import numpy as np

from bench.threads import ThreadClock, peak_rss_mib
from bench.world import slowest as _slowest

WARMUP = 5          # a training method's untimed steps before its clock starts


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


class Measured:
    """A method's timed loop, with its CPU per thread and (hand-fused) Allreduce CPU."""

    def __init__(self, comm: Any, warmup_s: float = 0.0) -> None:
        self.comm = comm
        self.warmup_s = warmup_s    # --warmup-seconds: untimed training before the loop
        self.warmup_steps = 0
        self.clock = ThreadClock()
        self.calls = 0
        self.allreduce_cpu = 0.0
        self.average_cpu = 0.0      # the hand-fused loop's division by the size
        self.tuning_steps = 0       # autotune: steps before its choice, and their time
        self.tuning_s = 0.0
        self.choice = ""            # autotune: the settings it changed

    def warm_up(self, step: Callable[[], None], since: float) -> None:
        """Train untimed until ``warmup_s`` seconds have passed since ``since`` on rank 0's
        clock (every rank stops at the same step: rank 0 says when), so that every method
        is timed after the same time in training, autotune's search included."""
        if self.warmup_s <= 0:
            return
        while not self.comm.bcast(time.perf_counter() - since >= self.warmup_s, root=0):
            step()
            self.warmup_steps += 1

    def timed(self, step: Callable[[], None], seconds: float,
              since: Optional[float] = None) -> float:
        """Steps per second on the slowest rank, after ``warm_up`` (counted from ``since``,
        the first step, where training began earlier: autotune's search); the CPU clock
        runs over the timed calls."""
        self.warm_up(step, time.perf_counter() if since is None else since)
        def counted() -> None:
            if self.calls == WARMUP:
                self.clock.start()
                self.allreduce_cpu = self.average_cpu = 0.0
            self.calls += 1
            step()
        rate = 1.0 / seconds_per_call(counted, seconds, self.comm, warmup=WARMUP, min_calls=10)
        self.clock.stop()
        return rate

    def result(self, samples_per_s: float) -> dict:
        steps = max(self.calls - WARMUP, 1)
        mine = {f"cpu_{k}": v / steps for k, v in self.clock.seconds.items()}
        mine["cpu_allreduce"] = self.allreduce_cpu / steps
        mine["cpu_average"] = self.average_cpu / steps
        every = self.comm.allgather(mine)
        result = {k: sum(r[k] for r in every) / len(every) for k in mine}
        result["samples_per_s"] = samples_per_s
        result["peak_rss_mib"] = max(self.comm.allgather(peak_rss_mib()))
        if self.warmup_s > 0:
            result["warmup_steps"] = self.warmup_steps
        if self.choice:
            result.update(tuning_steps=self.tuning_steps, tuning_s=self.tuning_s,
                          choice=self.choice)
        return result
