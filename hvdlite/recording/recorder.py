"""What ``HVDLITE_REPORT`` records on each rank while training runs.

Two clocks, each touched by one thread only:

* ``PeerWaitClock`` (engine thread): the time during which at least one of this
  rank's requests was submitted but not yet agreed by every rank of its set.
  A rank that submits its gradients early waits here for the slowest peer; the
  slowest rank itself barely waits. It also holds the engine's own queueing
  behind an earlier reduction, which every rank has alike.
* ``StepRecorder`` (user thread): optimizer step boundaries, time blocked in the
  optimizer's ``synchronize()`` and in other collectives, and at each boundary a
  ``Mark`` of every running total (the engine's peer wait and byte counts are
  read as single floats and ints, atomic under the GIL).
* ``ReductionCount`` (engine thread): allreduce reductions run (a fused bucket is
  one), the tensors in them and their bytes, what the scaling forecast reads. On one
  rank an optimizer reduces nothing; it tells the ``StepRecorder`` of each gradient it
  skips instead (``unreduced``), so the forecast still learns a one-rank run's.

Per-step figures are differences between the first and the last mark, so the
set-up (``broadcast_parameters``, whose first collective waits for the slowest
rank to import its framework) and the shutdown are outside them.

Cost per step: four ``perf_counter()`` calls, a few additions and one tuple per
boundary; nothing allocates per tensor (the engine replaces one tuple per reduction,
report or not). To measure it, time a training loop of a few thousand steps with and
without ``HVDLITE_REPORT`` on an idle machine, alternating the two runs, and compare
the median step times.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable, NamedTuple, Optional


class PeerWaitClock:
    """Engine thread only; ``total`` may be read from any thread."""
    __slots__ = ("total", "since", "_settled_at")

    def __init__(self) -> None:
        self.total = 0.0                    # seconds, closed intervals only
        self.since: Optional[float] = None  # start of the open interval (time.monotonic)
        self._settled_at = 0.0

    def submitted(self, at: float) -> None:
        """A request submitted ``at`` reached the engine. A request still queued when
        the last interval closed starts the next one at that close, not before it,
        so no time is counted twice."""
        if self.since is None:
            self.since = max(at, self._settled_at)

    def settled(self, now: float) -> None:
        """No request of this rank is waiting any more: close the open interval."""
        if self.since is not None:
            self.total += now - self.since
            self.since = None
            self._settled_at = now


RECENT_STEPS = 256    # step times kept for their spread (a fixed list: no growth)


def robust_sd(values: list[float]) -> float:
    """The standard deviation a normal spread would have, from the median absolute
    deviation: the forecast's wait for the slowest of P ranks scales with it, and a
    few slow steps (warm-up, a garbage collection) must not pass for a wide spread."""
    if len(values) < 2:
        return 0.0
    ordered = sorted(values)
    middle = statistics.median(ordered)
    return 1.4826 * statistics.median(sorted(abs(v - middle) for v in ordered))


class ReductionCount:
    """Engine thread writes; ``totals`` (reductions, tensors, bytes) is replaced whole,
    so any thread reads a consistent triple without a lock. ``classes`` counts the
    reductions by size class (``nbytes.bit_length()``: class k holds sizes from
    2^(k-1) to 2^k - 1): autotune's ring thresholds are the bounds between the
    classes a model's steps produce. Read it with ``dict(...)`` (one C call)."""
    __slots__ = ("totals", "classes")

    def __init__(self) -> None:
        self.totals = (0, 0, 0)
        self.classes: dict[int, int] = {}

    def add(self, tensors: int, nbytes: int) -> None:
        reductions, count, total = self.totals
        self.totals = (reductions + 1, count + tensors, total + nbytes)
        key = nbytes.bit_length()
        self.classes[key] = self.classes.get(key, 0) + 1


class Mark(NamedTuple):
    """Running totals at one optimizer step boundary."""
    at: float            # perf_counter
    comm_wait: float     # blocked in the optimizer's synchronize (seconds)
    other_wait: float    # blocked in collectives outside an optimizer (seconds)
    peer_wait: float     # the engine's PeerWaitClock.total (seconds)
    sent: int            # bytes, every host backend
    received: int
    estimated: int       # bytes of sent + received that are estimates (MPI's own collectives)
    reductions: int = 0  # allreduce reductions run (ReductionCount)
    tensors: int = 0     # ... the tensors in them
    reduced: int = 0     # ... and their bytes


class StepRecorder:
    """User thread: one per process while HVDLITE_REPORT is set.

    ``totals()`` returns (peer wait, bytes sent, bytes received, of which
    estimated) from the engine;
    ``sample()`` is called every ``sample_every`` steps (GPU memory and use);
    ``reduced()`` returns the engine's ReductionCount totals.
    """

    def __init__(self, totals: Callable[[], tuple[float, int, int, int]],
                 sample: Optional[Callable[[], None]] = None, sample_every: int = 16,
                 reduced: Callable[[], tuple[int, int, int]] = lambda: (0, 0, 0)) -> None:
        self._totals = totals
        self._reduced = reduced
        self._sample = sample
        self._sample_every = sample_every
        self.comm_wait = 0.0
        self.other_wait = 0.0
        self.other_calls = 0
        self.steps = 0                  # boundaries seen; the window holds steps - 1
        self.first: Optional[Mark] = None
        self.last: Optional[Mark] = None
        self._depth = 0                 # > 0 inside an optimizer's synchronize
        self.unreduced_tensors = 0      # gradients a one-rank optimizer did not reduce
        self.unreduced_bytes = 0
        self._recent = [0.0] * RECENT_STEPS   # the last step times, for their spread
        # Called at every step boundary after it is recorded (HVDLITE_AUTOTUNE's tuner).
        self.listeners: list[Callable[[], None]] = []

    def optimizer_wait_begin(self) -> float:
        self._depth += 1
        return time.perf_counter()

    def optimizer_wait_end(self, started: float) -> None:
        self._depth -= 1
        self.comm_wait += time.perf_counter() - started

    def collective_wait(self, seconds: float) -> None:
        """A blocking wait in ``synchronize``; inside an optimizer it is already counted."""
        if self._depth == 0:
            self.other_wait += seconds
            self.other_calls += 1

    def unreduced(self, nbytes: int) -> None:
        """A one-rank optimizer skipped reducing a gradient of ``nbytes``."""
        self.unreduced_tensors += 1
        self.unreduced_bytes += nbytes

    def step_done(self) -> None:
        """An optimizer step finished (its update applied): a step boundary."""
        reductions, tensors, reduced = self._reduced()
        alone = self.unreduced_tensors      # each would be its own reduction on P ranks
        mark = Mark(time.perf_counter(), self.comm_wait, self.other_wait, *self._totals(),
                    reductions + alone, tensors + alone, reduced + self.unreduced_bytes)
        if self.last is None:
            self.first = mark
        else:
            self._recent[(self.steps - 1) % RECENT_STEPS] = mark.at - self.last.at
        self.last = mark
        self.steps += 1
        if self._sample is not None and (self.steps - 1) % self._sample_every == 0:
            self._sample()
        for listener in self.listeners:
            listener()

    def window(self) -> dict[str, Any]:
        """Per-step means over the window between the first and last boundary."""
        first, last = self.first, self.last
        steps = self.steps - 1
        if first is None or last is None or steps < 1:
            return {"steps": 0}
        mean = (last.at - first.at) / steps
        return {
            "steps": steps,
            "step_time_s": mean,
            "step_time_sd_s": robust_sd(self._recent[:min(steps, RECENT_STEPS)]),
            "optimizer_wait_s": (last.comm_wait - first.comm_wait) / steps,
            "other_wait_s": (last.other_wait - first.other_wait) / steps,
            "peer_wait_s": (last.peer_wait - first.peer_wait) / steps,
            "bytes_sent": (last.sent - first.sent) / steps,
            "bytes_received": (last.received - first.received) / steps,
            "bytes_estimated": last.estimated > first.estimated,
            "allreduce_calls": (last.reductions - first.reductions) / steps,
            "allreduce_tensors": (last.tensors - first.tensors) / steps,
            "allreduce_bytes": (last.reduced - first.reduced) / steps,
        }
