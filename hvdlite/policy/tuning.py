"""HVDLITE_AUTOTUNE's search: which settings to try, in what order, which to keep.

Pure (no MPI, no clock), so it is unit-tested on made-up scores. Rank 0 runs it,
fed each trial's agreed score (the slowest rank's median step time); the other
ranks learn its decisions by broadcast (``hvdlite.diagnostics.autotune``), so ranks whose
clocks disagree can never end up on different settings.

The search is coordinate descent, one knob at a time in the order of their
measured effect on this machine (the reduction path first): each candidate value
of a knob runs as a trial with every other knob at the best value so far, and
the best candidate replaces the incumbent only when it is faster by ``MARGIN``
(less is within one sample's noise). Knobs that cannot matter for the model are
skipped, judged from what the baseline trial reduced: no ring threshold between
sizes the model never produces, no fusion knobs when nothing is packed.

Then, when the descent ended anywhere but the starting settings, a confirmation:
the start and the choice alternate for ``CONFIRM_ROUNDS`` trials each (A B B A,
close in time, so that a steady drift of the machine's speed hits both alike),
and the choice is kept only if it is still faster there. So autotune ends on the defaults unless something measurably beat
them side by side.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, Optional, Sequence

from hvdlite.config import Config
from hvdlite.config_values import ONE_BUCKET
from hvdlite.policy.defaults import NO_RING, describe_bytes

MARGIN = 0.02            # a candidate must be 2% faster than the incumbent to replace it
CONFIRM_ROUNDS = 2       # trials each of the start and the choice, alternating
SAMPLE_SECONDS = 0.25    # a trial lasts at least this long (short steps: more of them)
MAX_STEPS_PER_SAMPLE = 200
MAX_TRIALS = 24          # the descent stops here; the confirmation still runs
MIN_RING_CLASS = 17      # sizes from 64 KiB: below, MPI's latency always wins
MAX_PATHS = 4            # ring thresholds tried (the model's size classes, sampled)

# Every setting autotune may change, in the order the search visits them.
TUNED = ("ring_threshold", "bucket_bytes", "ring_chunk", "fusion_threshold",
         "direct_threshold", "spin_time", "cycle_time")


@dataclasses.dataclass(frozen=True)
class Knob:
    """One setting and the values to try for it (including the current one)."""
    name: str
    values: tuple[Any, ...]
    # Whether the knob can matter under the incumbent settings (the ring's chunk
    # only while the ring runs): asked when its turn comes.
    applies: Callable[[Mapping[str, Any]], bool] = lambda settings: True


@dataclasses.dataclass(frozen=True)
class Trial:
    """One measured candidate: what ran, for how many steps, how fast, and what the
    search made of it."""
    index: int
    phase: str                      # "baseline", a knob's name, or "confirm"
    settings: dict[str, Any]
    steps: int
    score: float                    # seconds per step: the slowest rank's median
    per_rank: tuple[float, ...]     # each rank's median
    decision: str = ""


def render(name: str, value: Any) -> str:
    """A setting's value as the log and the report show it."""
    if name == "bucket_bytes":
        return describe_bytes(int(value), unbounded="all")
    if name in ("ring_threshold", "ring_chunk", "fusion_threshold", "direct_threshold"):
        return describe_bytes(int(value))
    if name in ("spin_time",):
        return f"{value:g} us"
    if name in ("cycle_time",):
        return f"{value:g} ms"
    return str(value)


def describe(settings: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={render(k, v)}" for k, v in settings.items())


class Search:
    """Coordinate descent, then a side-by-side confirmation (see the module doc).

    ``plan(baseline_trial)`` returns the knobs, once the baseline is measured (what
    it reduced decides which knobs can matter). ``current`` is the trial to run;
    ``record(score, per_rank)`` scores it and moves on; ``done`` at the end, with
    ``chosen`` and ``reason``.
    """

    def __init__(self, baseline: Mapping[str, Any], plan: Callable[[], Sequence[Knob]],
                 steps_per_sample: int, margin: float = MARGIN,
                 confirm_rounds: int = CONFIRM_ROUNDS, max_trials: int = MAX_TRIALS) -> None:
        self.baseline = dict(baseline)
        self.incumbent = dict(baseline)
        self.incumbent_score = math.inf
        self.steps = steps_per_sample
        self.trials: list[Trial] = []
        self.done = False
        self.chosen = dict(baseline)
        self.reason = ""
        self._plan, self._margin = plan, margin
        self._confirm_rounds, self._max_trials = confirm_rounds, max_trials
        self._knobs: list[Knob] = []
        self._queue: list[tuple[str, dict[str, Any]]] = [("baseline", dict(baseline))]
        self._knob_trials: list[Trial] = []
        self._confirm: list[Trial] = []

    @property
    def current(self) -> tuple[str, dict[str, Any]]:
        return self._queue[0]

    def record(self, score: float, per_rank: Sequence[float]) -> Trial:
        """Score the current trial; returns it with the search's verdict on it."""
        phase, settings = self._queue.pop(0)
        trial = Trial(len(self.trials), phase, settings, self.steps, score, tuple(per_rank))
        if phase == "baseline":
            trial = self._after_baseline(trial)
        elif phase == "confirm":
            self._confirm.append(trial)
            if not self._queue:
                trial = dataclasses.replace(trial, decision=self._finish_confirmation())
        else:
            self._knob_trials.append(trial)
            if not self._queue or self._queue[0][0] != phase:
                trial = dataclasses.replace(trial, decision=self._close_knob(phase))
        self.trials.append(trial)
        if not self._queue and not self.done:
            self._advance()
        return self.trials[-1]

    # -- the phases ---------------------------------------------------------------------
    def _after_baseline(self, trial: Trial) -> Trial:
        self.incumbent_score = trial.score
        self._knobs = list(self._plan())
        # Short steps: more of them per trial, so that one trial outlasts scheduling noise.
        if trial.score > 0:
            wanted = math.ceil(SAMPLE_SECONDS / trial.score)
            self.steps = max(self.steps, min(wanted, MAX_STEPS_PER_SAMPLE))
        names = ", ".join(k.name for k in self._knobs) or "none"
        return dataclasses.replace(trial, decision=f"start; knobs to try: {names}; "
                                                   f"{self.steps} steps per trial")

    def _advance(self) -> None:
        """Queue the next knob's candidates, or the confirmation, or finish."""
        while self._knobs and len(self.trials) < self._max_trials:
            knob = self._knobs.pop(0)
            if not knob.applies(self.incumbent):
                continue
            candidates = [{**self.incumbent, knob.name: value} for value in knob.values
                          if value != self.incumbent.get(knob.name)]
            if candidates:
                self._queue = [(knob.name, c) for c in candidates]
                return
        if self.incumbent == self.baseline:
            self._end(self.baseline, "no candidate beat the starting settings by "
                                     f"{self._margin:.0%}; they stay")
            return
        # A B B A B A...: a steady drift of the machine's speed cancels out in pairs,
        # where A B A B would favour whichever runs second.
        pair = [("confirm", dict(self.baseline)), ("confirm", dict(self.incumbent))]
        self._queue = [entry for i in range(self._confirm_rounds)
                       for entry in (pair if i % 2 == 0 else pair[::-1])]

    def _close_knob(self, name: str) -> str:
        trials, self._knob_trials = self._knob_trials, []
        best = min(trials, key=lambda t: t.score)      # the first of equals: stable
        if best.score < self.incumbent_score * (1.0 - self._margin):
            before = self.incumbent.get(name)
            gain = 1.0 - best.score / self.incumbent_score
            self.incumbent, self.incumbent_score = dict(best.settings), best.score
            return (f"{name}: {render(name, best.settings[name])} replaces "
                    f"{render(name, before)} ({gain:.1%} faster)")
        return (f"{name}: keeps {render(name, self.incumbent.get(name))} (best other "
                f"{render(name, best.settings[name])}, {best.score * 1e3:.2f} ms against "
                f"{self.incumbent_score * 1e3:.2f} ms)")

    def _finish_confirmation(self) -> str:
        start = [t.score for t in self._confirm if t.settings == self.baseline]
        mine = [t.score for t in self._confirm if t.settings != self.baseline]
        start_ms, mine_ms = 1e3 * sum(start) / len(start), 1e3 * sum(mine) / len(mine)
        side_by_side = (f"side by side, {mine_ms:.2f} ms per step against {start_ms:.2f} "
                        "ms with the starting settings")
        if mine_ms < start_ms:
            return self._end(self.incumbent, f"chosen: {side_by_side}")
        return self._end(self.baseline, f"starting settings kept: the descent's choice "
                                        f"({describe(self._changes(self.incumbent))}) was "
                                        f"not faster {side_by_side}")

    def _end(self, chosen: Mapping[str, Any], reason: str) -> str:
        self.done, self.chosen, self.reason = True, dict(chosen), reason
        self._queue = []
        return reason

    def _changes(self, settings: Mapping[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in settings.items() if self.baseline.get(k) != v}

    def changes(self) -> dict[str, Any]:
        """The chosen settings that differ from the starting ones."""
        return self._changes(self.chosen)


# -- which knobs, with which values ------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Observed:
    """What the baseline trial reduced: reductions by size class (see
    core.recorder.ReductionCount), and whether tensors were packed together."""
    classes: Mapping[int, int]
    packed: bool


def ring_thresholds(current: int, classes: Sequence[int]) -> tuple[int, ...]:
    """Ring thresholds that split the model's size classes differently: each class's
    lower bound (that class and the larger ones on the ring) and NO_RING (none), one
    per distinct split, the current threshold standing for its own; at most MAX_PATHS,
    keeping the current one, all-ring and none."""
    sizes = sorted(k for k in set(classes) if k >= MIN_RING_CLASS)
    if not sizes:
        return (current,)

    def split(threshold: int) -> tuple[int, ...]:
        return tuple(k for k in sizes if (1 << (k - 1)) >= threshold)
    chosen: dict[tuple[int, ...], int] = {split(current): current}
    for threshold in [1 << (k - 1) for k in sizes] + [NO_RING]:
        chosen.setdefault(split(threshold), threshold)
    values = sorted(chosen.values())
    if len(values) > MAX_PATHS:
        keep = {current, values[0], values[-1]}
        middle = [v for v in values if v not in keep]
        keep.update(middle[len(middle) // 2: len(middle) // 2 + MAX_PATHS - len(keep)])
        values = sorted(keep)
    return tuple(values)


def bucket_caps(cap: int) -> tuple[int, ...]:
    """The bucket caps to try from ``cap``: a quarter, it, four times it, and one bucket
    (no overlap, the fewest rounds); from one bucket, the fixed default beside it."""
    if cap >= ONE_BUCKET:
        return (Config().bucket_bytes, ONE_BUCKET)
    return (max(cap // 4, 1 << 20), cap, cap * 4, ONE_BUCKET)


def plan(config: Any, fixed: set[str], observed: Observed,
         followed: set[str]) -> list[Knob]:
    """The knobs worth trying for this run, in TUNED order. ``fixed``: settings the
    user gave (never tuned); ``followed``: settings outside the engine that a binding
    follows when they change (the gradient buckets); the engine's own always apply."""
    knobs: list[Knob] = []
    auto = config.allreduce == "auto"

    def ring_runs(settings: Mapping[str, Any]) -> bool:
        if config.allreduce == "ring":
            return True
        return auto and any(1 << (k - 1) >= settings["ring_threshold"]
                            for k in observed.classes if k >= MIN_RING_CLASS)
    if auto and "ring_threshold" not in fixed:
        paths = ring_thresholds(config.ring_threshold, list(observed.classes))
        if len(paths) > 1:
            knobs.append(Knob("ring_threshold", paths))
    if "bucket_bytes" in followed and config.bucket_bytes:
        knobs.append(Knob("bucket_bytes", bucket_caps(config.bucket_bytes)))
    if config.allreduce in ("auto", "ring"):
        chunk = config.ring_chunk
        knobs.append(Knob("ring_chunk", (max(chunk // 4, 4 << 10), chunk, chunk * 4),
                          applies=ring_runs))
    if observed.packed:
        fusion, direct = config.fusion_threshold, config.direct_threshold
        knobs.append(Knob("fusion_threshold", tuple(sorted({0, 4 << 20, fusion}))))
        knobs.append(Knob("direct_threshold", (max(direct // 4, 4 << 10), direct, direct * 4),
                          applies=lambda settings: settings["fusion_threshold"] > 0))
    knobs.append(Knob("spin_time", tuple(sorted({0.0, 100.0, float(config.spin_time)}))))
    cycle = config.cycle_time
    knobs.append(Knob("cycle_time", (cycle / 4, cycle, cycle * 5) if cycle > 0 else (0.0, 1.0)))
    return [k for k in knobs if k.name not in fixed]


def starting_settings(config: Any) -> dict[str, Any]:
    """The values of every setting autotune may change, as they stand."""
    return {name: getattr(config, name) for name in TUNED}


def report_lines(record: Optional[Mapping[str, Any]]) -> list[str]:
    """The report's lines on how the settings were chosen (api.report's "settings"
    record): the topology-aware defaults, then autotune's choice and the trials that
    decided it."""
    if not record:
        return []
    lines = [f"default: {reason}" for reason in record.get("defaults") or ()]
    tuned = record.get("autotune")
    if not tuned:
        return lines
    trials = tuned["trials"]
    if not tuned["finished"]:
        lines.append(f"autotune: unfinished: training ended after {len(trials)} trials, "
                     "before a choice (more steps, or fewer per trial: "
                     "HVDLITE_AUTOTUNE_STEPS_PER_SAMPLE)")
    else:
        chosen = describe(tuned["changes"]) or "the starting settings"
        lines.append(f"autotune: {chosen}, after {len(trials)} trials in the first "
                     f"{tuned['tuning_steps']} steps; {tuned['reason']}")
    for trial in trials:
        if trial["decision"]:
            lines.append(f"  trial {trial['index']} ({trial['phase']}): "
                         f"{trial['score'] * 1e3:.2f} ms per step; {trial['decision']}")
    if tuned["fixed"]:
        lines.append(f"  not tuned (set by the user): {', '.join(tuned['fixed'])}")
    return lines
