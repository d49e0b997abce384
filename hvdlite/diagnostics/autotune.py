"""HVDLITE_AUTOTUNE on the user thread: time optimizer steps, agree on each trial's
score, switch every rank to the next candidate at the same step boundary.

Step boundaries. The DistributedOptimizers (torch, Keras) mark one after each
update through the step recorder (``hvdlite.recording.recorder.StepRecorder``), which
calls its ``listeners``; with HVDLITE_AUTOTUNE a recorder runs even without
HVDLITE_REPORT, and the tuner is one of its listeners. A loop without hvdlite's
optimizer (a hand-written allreduce, TensorFlow's DistributedGradientTape) marks
its steps with ``hvd.step_done()`` (``hvdlite.api.runtime.step_done``). Every rank must mark the same steps: the
trials end, and their collectives run, at a count of boundaries.

At the boundary that ends a trial, every rank, in this order:

1. allgathers its median step time over the trial (``hvdlite.autotune.times``);
2. rank 0 scores the trial with the slowest rank's median (that rank sets
   everyone's pace) and asks the search (``hvdlite.policy.tuning``) what next;
3. rank 0's decision is broadcast (``hvdlite.autotune.decision``): every rank
   runs what rank 0 decided, whatever its own clock said;
4. where the settings change, ``reconfigure`` applies them (a negotiated request:
   every rank switches at the same point in the order of collectives), and the
   bindings that follow a setting outside the engine are told (``follow``).

Rank 0 writes every trial to HVDLITE_AUTOTUNE_LOG as it ends (CSV), then the
choice; the report (HVDLITE_REPORT) shows the choice and why.
"""
from __future__ import annotations

import csv
import inspect
import logging
import os
import statistics
import time
import weakref
from typing import Any, Callable, Optional, Sequence

import numpy as np

from hvdlite.api import collectives, objects, runtime, submission
from hvdlite.api.adapter import NUMPY
from hvdlite.api.control import reconfigure
from hvdlite.config import fields_set
from hvdlite.diagnostics import report  # noqa: F401  (registers its start hook before ours)
from hvdlite.errors import OutputPathError
from hvdlite.policy import tuning as search
from hvdlite.recording.outputs import open_for_writing
from hvdlite.recording.recorder import StepRecorder

_log = logging.getLogger("hvdlite")

# Settings outside the engine that a binding applies itself when they change
# (bucket_bytes: the torch optimizer's buckets), with the callbacks to tell it: a bound
# method is held weakly (an optimizer that is dropped stops following), anything else
# as given (wrapped so that both are called alike).
FOLLOWERS: dict[str, list[Callable[[], Optional[Callable[[Any], None]]]]] = {}


def follow(setting: str, callback: Callable[[Any], None]) -> Callable[[], None]:
    """Register ``callback(value)``, called on every rank at the step boundary where
    autotune changes ``setting`` (after the engine has it). A setting outside the
    engine is tried only while something follows it: the torch optimizer and the
    reducer's gradient lists register ``follow("bucket_bytes", ...)`` and lay their
    buckets out again when the next gradient arrives. A bound method is held weakly: its object may be dropped without
    unregistering. Returns a function that unregisters ``callback``."""
    reference: Callable[[], Optional[Callable[[Any], None]]]
    if inspect.ismethod(callback):
        reference = weakref.WeakMethod(callback)
    else:
        reference = lambda: callback      # noqa: E731
    FOLLOWERS.setdefault(setting, []).append(reference)

    def forget() -> None:
        if reference in FOLLOWERS.get(setting, []):
            FOLLOWERS[setting].remove(reference)
    return forget


def followers(setting: str) -> list[Callable[[Any], None]]:
    """The live callbacks following ``setting`` (dropped objects' are let go)."""
    live = [(reference, reference()) for reference in FOLLOWERS.get(setting, [])]
    FOLLOWERS[setting] = [reference for reference, callback in live if callback is not None]
    return [callback for _, callback in live if callback is not None]


def tuner() -> Optional["Tuner"]:
    """The tuner of this session (None without HVDLITE_AUTOTUNE)."""
    return runtime.RUNTIME.tuner


def finished() -> bool:
    """Whether autotune has chosen (True too when it is not running): the same on
    every rank at every step boundary, since rank 0's decision says when."""
    current = tuner()
    return current is None or current.finished


class Tuner:
    """One per process while autotune runs; ``step_done`` is its step boundary.

    ``clock`` and ``planner`` are seams for tests: a fake clock per rank makes the
    ranks' timings disagree on purpose, a planner fixes the knobs to try."""

    def __init__(self, config: Any, rank: int, counts: Any = None, log_path: str = "",
                 fixed: Optional[set[str]] = None,
                 clock: Callable[[], float] = time.perf_counter,
                 planner: Optional[Callable[[search.Observed], Sequence[search.Knob]]] = None
                 ) -> None:
        self.rank = rank
        self.settings = search.starting_settings(config)
        self.fixed = set(fields_set()) if fixed is None else set(fixed)
        self.finished = False
        self.trials: list[dict[str, Any]] = []       # every rank: what rank 0 decided
        self.reason = ""
        self.tuning_steps = 0
        self._config, self._counts, self._clock = config, counts, clock
        self._planner = planner
        self._steps = config.autotune_steps_per_sample
        self._boundaries = 0
        self._trial_start = max(config.autotune_warmup_steps, 1)
        self._previous = 0.0
        self._times: list[float] = []
        self._seen: tuple[tuple[int, int, int], dict[int, int]] = ((0, 0, 0), {})
        self._search: Optional[search.Search] = None
        self._log: Optional[Any] = None
        if rank == 0:
            self._search = search.Search(self.settings, self._plan, self._steps)
            self._log = _CsvLog.open(log_path) if log_path else None

    # -- the step boundary --------------------------------------------------------------
    def step_done(self) -> None:
        now = self._clock()
        self._boundaries += 1
        previous, self._previous = self._previous, now
        if self.finished or self._boundaries < self._trial_start:
            return
        if self._boundaries == self._trial_start:     # the first trial starts here
            self._seen = self._observe()
            return
        if self._boundaries == self._trial_start + 1:
            return          # the step after a switch runs once untimed (buffers, caches)
        self._times.append(now - previous)
        if len(self._times) >= self._steps:
            self._end_trial()
            self._trial_start = self._boundaries
            self._previous = self._clock()

    def _end_trial(self) -> None:
        median, self._times = statistics.median(self._times), []
        mine = np.array([median], dtype=np.float64)
        per_rank = [float(t) for t in submission.synchronize(
            collectives.allgather_async(NUMPY, mine, "hvdlite.autotune.times", None))]
        decision = self._decide(per_rank) if self._search is not None else None
        decision = objects.broadcast_object(decision, 0, "hvdlite.autotune.decision")
        self._apply(decision)

    def _decide(self, per_rank: list[float]) -> dict[str, Any]:
        """Rank 0: what runs next. Whatever goes wrong here, the other ranks are waiting
        in the broadcast: they get a decision to stop on the starting settings."""
        try:
            return self._next(per_rank)
        except Exception as exc:    # a bug in the search: stop tuning, never hang a rank
            _log.error("HVDLITE_AUTOTUNE failed on rank 0 (a bug, please report it); the "
                       "starting settings stay: %r", exc)
            start = self.trials[0]["settings"] if self.trials else self.settings
            return {"trial": None, "settings": dict(start), "steps": self._steps,
                    "done": True, "reason": f"autotune failed ({exc!r}): starting settings kept"}

    def _next(self, per_rank: list[float]) -> dict[str, Any]:
        """Rank 0: score the trial by its slowest rank, and what runs next."""
        found = self._search
        assert found is not None
        trial = found.record(max(per_rank), per_rank)
        row = {"index": trial.index, "phase": trial.phase, "settings": trial.settings,
               "steps": trial.steps, "score": trial.score, "per_rank": list(trial.per_rank),
               "decision": trial.decision}
        settings = found.chosen if found.done else found.current[1]
        return {"trial": row, "settings": dict(settings), "steps": found.steps,
                "done": found.done, "reason": found.reason}

    def _apply(self, decision: dict[str, Any]) -> None:
        if decision["trial"] is not None:
            self.trials.append(decision["trial"])
            if self._log is not None:
                self._log.trial(decision["trial"])
        changes = {k: v for k, v in decision["settings"].items() if self.settings.get(k) != v}
        if changes:
            # Named: a Keras step on TensorFlow marks its boundary from a py_function, on
            # a pool thread whose name differs between ranks (unnamed ops pair by thread).
            reconfigure(name="hvdlite.autotune.reconfigure", **changes)
            for name, value in changes.items():
                for callback in followers(name):
                    callback(value)
        self.settings, self._steps = dict(decision["settings"]), decision["steps"]
        if decision["done"]:
            self.finished, self.reason = True, decision["reason"]
            self.tuning_steps = self._boundaries
            if self._log is not None:
                self._log.chosen(self.settings, self.tuning_steps, self.reason)
                self._log.close()
            if self.rank == 0:
                _log.info("autotune: %s (%s)", search.describe(self.changes()) or
                          "the starting settings", self.reason)

    # -- what the baseline reduced decides the knobs -------------------------------------
    def _observe(self) -> tuple[tuple[int, int, int], dict[int, int]]:
        counts = self._counts
        return (counts.totals, dict(counts.classes)) if counts is not None else ((0, 0, 0), {})

    def _plan(self) -> list[search.Knob]:
        (reductions0, tensors0, _), classes0 = self._seen
        (reductions1, tensors1, _), classes1 = self._observe()
        classes = {k: n - classes0.get(k, 0) for k, n in classes1.items()
                   if n > classes0.get(k, 0)}
        observed = search.Observed(classes, tensors1 - tensors0 > reductions1 - reductions0)
        if self._planner is not None:
            return list(self._planner(observed))
        followed = {name for name in list(FOLLOWERS) if followers(name)}
        return search.plan(self._config, self.fixed, observed, followed)

    # -- what the report shows ------------------------------------------------------------
    def changes(self) -> dict[str, Any]:
        start = self.trials[0]["settings"] if self.trials else self.settings
        return {k: v for k, v in self.settings.items() if start.get(k) != v}

    def summary(self) -> dict[str, Any]:
        return {"finished": self.finished, "reason": self.reason, "trials": self.trials,
                "settings": dict(self.settings), "changes": self.changes(),
                "tuning_steps": self.tuning_steps,
                "fixed": sorted(self.fixed & set(search.TUNED))}


class _CsvLog:
    """Rank 0's HVDLITE_AUTOTUNE_LOG: a header, a row per trial as it ends (flushed,
    so a crash leaves what was measured), the choice last."""
    COLUMNS = ("trial", "phase", *search.TUNED, "steps", "step_ms", "rank_step_ms", "decision")

    def __init__(self, handle: Any) -> None:
        self._handle = handle
        self._writer = csv.writer(handle)
        self._writer.writerow(self.COLUMNS)
        handle.flush()

    @classmethod
    def open(cls, path: str) -> Optional["_CsvLog"]:
        try:
            return cls(os.fdopen(open_for_writing(path, "the autotune log"), "w", newline=""))
        except (OSError, OutputPathError) as exc:   # checked at init: only with ..._CHECK=warn
            _log.warning("HVDLITE_AUTOTUNE_LOG: %s; autotune runs without its log", exc)
            return None

    def _row(self, cells: list[Any]) -> None:
        self._writer.writerow(cells)
        self._handle.flush()

    def trial(self, row: dict[str, Any]) -> None:
        self._row([row["index"], row["phase"], *(row["settings"][k] for k in search.TUNED),
                   row["steps"], f"{row['score'] * 1e3:.3f}",
                   ";".join(f"{t * 1e3:.3f}" for t in row["per_rank"]), row["decision"]])

    def chosen(self, settings: dict[str, Any], steps: int, reason: str) -> None:
        self._row(["chosen", "final", *(settings[k] for k in search.TUNED), steps, "", "",
                   reason])

    def close(self) -> None:
        self._handle.close()


def _on_start(engine: Any, config: Any) -> None:
    """After the report's hook (this module imports it): a recorder to hear step
    boundaries, made here when no report asked for one."""
    runtime.RUNTIME.tuner = None
    if not config.autotune:
        return
    if engine.topology.size == 1:
        _log.info("HVDLITE_AUTOTUNE: one rank, nothing is reduced: nothing to tune")
        return
    rank = engine.topology.rank
    attach(Tuner(config, rank, engine.executor.reductions,
                 config.autotune_log if rank == 0 else ""))


def attach(current: Tuner) -> Callable[[], None]:
    """Make ``current`` this session's tuner, hearing every step boundary (through the
    report's recorder, or one made for it); returns a function that detaches it."""
    recorder = runtime.RUNTIME.recorder
    if recorder is None:
        recorder = runtime.RUNTIME.recorder = StepRecorder(lambda: (0.0, 0, 0, 0))
    recorder.listeners.append(current.step_done)
    runtime.RUNTIME.tuner = current

    def detach() -> None:
        if current.step_done in recorder.listeners:
            recorder.listeners.remove(current.step_done)
        if runtime.RUNTIME.tuner is current:
            runtime.RUNTIME.tuner = None
    return detach


# After the report's hook, which sets the recorder this one may add to: the import of
# hvdlite.diagnostics.report above registered it first.
runtime.START_HOOKS.append(_on_start)
