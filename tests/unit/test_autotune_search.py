"""HVDLITE_AUTOTUNE's search on made-up scores (no MPI, no clock): the order of the
trials, when a candidate replaces the incumbent, the side-by-side confirmation that
keeps the defaults unless they lost there, which knobs a model's reductions make worth
trying, and the settings' validation. (tests/mpi/test_autotune.py runs the tuner on
real ranks, with timings that disagree between them.)"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Callable, Mapping

import pytest

from hvdlite.config import Config, fields_set
from hvdlite.config_values import ONE_BUCKET
from hvdlite.errors import ConfigError
from hvdlite.policy import tuning
from hvdlite.policy.defaults import NO_RING
from hvdlite.policy.tuning import Knob, Observed, Search

START = {"spin_time": 100.0, "cycle_time": 1.0}
KNOBS = [Knob("spin_time", (0.0, 100.0)), Knob("cycle_time", (0.25, 1.0, 5.0))]
Score = Callable[[Mapping[str, Any]], float]


def run(score: Score, knobs: list[Knob] = KNOBS, start: Mapping[str, Any] = START,
        steps: int = 5) -> Search:
    """Drive a search to its end, scoring each trial with ``score(settings)``."""
    search = Search(start, lambda: knobs, steps)
    for _ in range(100):
        if search.done:
            return search
        value = score(search.current[1])
        search.record(value, [value])
    raise AssertionError("the search did not end")


def test_trials_visit_each_knob_in_order_with_the_best_so_far() -> None:
    def score(settings: Mapping[str, Any]) -> float:    # spin 0 helps, cycle 5 helps more
        return 1.0 - 0.1 * (settings["spin_time"] == 0.0) - 0.2 * (settings["cycle_time"] == 5.0)
    search = run(score)
    phases = [(t.phase, t.settings) for t in search.trials]
    assert phases[:4] == [
        ("baseline", START),
        ("spin_time", {"spin_time": 0.0, "cycle_time": 1.0}),
        ("cycle_time", {"spin_time": 0.0, "cycle_time": 0.25}),     # on the new incumbent
        ("cycle_time", {"spin_time": 0.0, "cycle_time": 5.0})]
    chosen = {"spin_time": 0.0, "cycle_time": 5.0}
    # The confirmation alternates A B B A: a steady drift cancels out in pairs.
    assert [t.settings for t in search.trials[4:]] == [START, chosen, chosen, START]
    assert search.chosen == chosen and search.changes() == chosen
    assert search.reason.startswith("chosen: side by side, 700.00 ms per step against 1000.00")


def test_a_gain_inside_the_margin_keeps_the_incumbent_and_the_defaults_end_it() -> None:
    search = run(lambda s: 1.0 - 0.01 * (s["spin_time"] == 0.0))      # 1% < MARGIN
    assert search.chosen == START and search.changes() == {}
    assert "keeps 100 us" in search.trials[1].decision
    assert search.reason.startswith("no candidate beat the starting settings")
    assert all(t.phase != "confirm" for t in search.trials)


def test_the_confirmation_reverts_a_choice_that_lost_side_by_side() -> None:
    """The descent saw cycle_time=5 faster once (a noisy moment); side by side it is
    slower: the defaults stay."""
    seen = {"n": 0}

    def score(settings: Mapping[str, Any]) -> float:
        seen["n"] += 1
        if settings["cycle_time"] == 5.0:
            return 0.5 if seen["n"] <= 5 else 1.1
        return 1.0
    search = run(score)
    assert search.chosen == START
    assert search.reason.startswith("starting settings kept: the descent's choice "
                                    "(cycle_time=5 ms) was not faster side by side")


def test_the_same_scores_give_the_same_trials_and_choice() -> None:
    def score(settings: Mapping[str, Any]) -> float:
        return 1.0 + 0.3 * settings["cycle_time"] - 0.001 * settings["spin_time"]
    first, second = run(score), run(score)
    assert first.trials == second.trials and first.chosen == second.chosen


def test_short_steps_get_more_steps_per_trial() -> None:
    search = Search(START, lambda: KNOBS, 5)
    search.record(0.010, [0.010])          # 10 ms steps: 25 make a quarter second
    assert search.steps == 25
    slow = Search(START, lambda: KNOBS, 5)
    slow.record(2.0, [2.0])
    assert slow.steps == 5


def test_a_knob_that_cannot_matter_is_skipped() -> None:
    knobs = [Knob("spin_time", (0.0, 100.0), applies=lambda s: False),
             Knob("cycle_time", (1.0, 5.0))]
    search = run(lambda s: 1.0, knobs)
    assert [t.phase for t in search.trials] == ["baseline", "cycle_time"]


def test_ring_thresholds_split_the_models_sizes_differently() -> None:
    mib = 1 << 20
    # Buckets of 1 MiB (class 21) and 25 MiB (class 25); a 4 KiB loss (class 13).
    classes = [13, 21, 25]
    assert tuning.ring_thresholds(2 * mib, classes) == (1 * mib, 2 * mib, NO_RING)
    # 2 MiB and 16 MiB split them alike: the current one stands for its split.
    assert tuning.ring_thresholds(16 * mib, classes) == (1 * mib, 16 * mib, NO_RING)
    assert tuning.ring_thresholds(NO_RING, classes) == (1 * mib, 16 * mib, NO_RING)
    assert tuning.ring_thresholds(2 * mib, [13]) == (2 * mib,)       # nothing large
    many = tuning.ring_thresholds(2 * mib, list(range(17, 30)))
    assert len(many) == tuning.MAX_PATHS and {1 << 16, 2 * mib, NO_RING} <= set(many)


def _config(**changes: Any) -> Any:
    return Config.load({}, **changes)


def test_plan_tries_only_what_can_matter_and_nothing_the_user_set() -> None:
    sizes = Observed({21: 10, 25: 20}, packed=False)
    names = [k.name for k in tuning.plan(_config(), set(), sizes, set())]
    assert names == ["ring_threshold", "ring_chunk", "spin_time", "cycle_time"]
    packed = Observed({21: 10}, packed=True)
    names = [k.name for k in tuning.plan(_config(), {"cycle_time"}, packed, {"bucket_bytes"})]
    assert names == ["ring_threshold", "bucket_bytes", "ring_chunk", "fusion_threshold",
                     "direct_threshold", "spin_time"]
    # HVDLITE_ALLREDUCE=mpi: no path and no ring to tune.
    names = [k.name for k in tuning.plan(_config(allreduce="mpi"), {"allreduce"}, sizes, set())]
    assert names == ["spin_time", "cycle_time"]
    chunk = next(k for k in tuning.plan(_config(), set(), sizes, set()) if k.name == "ring_chunk")
    assert chunk.applies({"ring_threshold": 2 << 20})
    assert not chunk.applies({"ring_threshold": NO_RING})       # no ring runs: no chunk


def test_bucket_caps_include_one_bucket_and_from_one_bucket_the_fixed_default() -> None:
    mib = 1 << 20
    assert tuning.bucket_caps(25 * mib) == (6 * mib + mib // 4, 25 * mib, 100 * mib, ONE_BUCKET)
    assert tuning.bucket_caps(2 * mib) == (mib, 2 * mib, 8 * mib, ONE_BUCKET)
    assert tuning.bucket_caps(ONE_BUCKET) == (25 * mib, ONE_BUCKET)
    assert tuning.render("bucket_bytes", ONE_BUCKET) == "all"
    assert tuning.render("ring_threshold", NO_RING) == "never"


def test_every_planned_value_is_a_valid_setting() -> None:
    observed = Observed({17: 1, 21: 1, 25: 1}, packed=True)
    config = _config()
    crowded = _config(bucket_bytes=ONE_BUCKET)
    for config in (config, crowded):
        for knob in tuning.plan(config, set(), observed, {"bucket_bytes"}):
            for value in knob.values:
                assert getattr(config.replace(**{knob.name: value}), knob.name) == value


def test_settings_and_their_horovod_names() -> None:
    config = Config.load({"HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_LOG": "/tmp/a.csv"})
    assert config.autotune and config.autotune_log == "/tmp/a.csv"
    assert Config.load({}).autotune is False
    assert fields_set({"HOROVOD_AUTOTUNE": "1", "HVDLITE_CYCLE_TIME": "2"}) == {
        "autotune", "cycle_time"}


@pytest.mark.parametrize("variable, value, message", [
    ("HVDLITE_AUTOTUNE", "sometimes", "expected 1/0"),
    ("HVDLITE_AUTOTUNE_STEPS_PER_SAMPLE", "0", "must be >= 1"),
    ("HVDLITE_AUTOTUNE_WARMUP_STEPS", "-1", "must be >= 0"),
])
def test_a_bad_value_is_a_config_error_naming_the_variable(variable: str, value: str,
                                                           message: str) -> None:
    with pytest.raises(ConfigError, match=f"{variable}={value!r} is invalid: {message}"):
        Config.load({variable: value})


def test_report_lines_say_what_was_chosen_and_why() -> None:
    trials = [{"index": 0, "phase": "baseline", "score": 0.5, "decision": "start; knobs: x"},
              {"index": 1, "phase": "spin_time", "score": 0.4, "decision": ""},
              {"index": 2, "phase": "spin_time", "score": 0.45,
               "decision": "spin_time: 0 us replaces 100 us (20.0% faster)"}]
    record = {"defaults": ["HVDLITE_RING_THRESHOLD=never (MPI's Allreduce at every size): "
                           "4 ranks compute on 2 CPUs of one node"],
              "autotune": {"finished": True, "trials": trials, "tuning_steps": 40,
                           "changes": {"spin_time": 0.0}, "reason": "chosen: side by side",
                           "fixed": ["cycle_time"]}}
    lines = tuning.report_lines(record)
    assert lines[0].startswith("default: HVDLITE_RING_THRESHOLD=never")
    assert lines[1] == ("autotune: spin_time=0 us, after 3 trials in the first 40 steps; "
                        "chosen: side by side")
    assert lines[2] == "  trial 0 (baseline): 500.00 ms per step; start; knobs: x"
    assert lines[3].startswith("  trial 2 (spin_time): 450.00 ms per step; spin_time: 0 us")
    assert lines[4] == "  not tuned (set by the user): cycle_time"
    unfinished = {"defaults": [], "autotune": {**record["autotune"], "finished": False}}
    assert tuning.report_lines(unfinished)[0].startswith("autotune: unfinished")
    assert tuning.report_lines(None) == [] and tuning.report_lines(
        {"defaults": [], "autotune": None}) == []


def test_the_autotune_log_is_checked_at_init_only_while_autotune_runs(tmp_path: Any) -> None:
    from hvdlite.recording import outputs
    missing = str(tmp_path / "missing" / "log.csv")
    on = SimpleNamespace(report="", timeline_path="", elastic_dir="", autotune=True,
                         autotune_log=missing)
    found = outputs.problems(on)
    assert [variable for variable, _ in found] == ["HVDLITE_AUTOTUNE_LOG"]
    assert f"its directory {tmp_path / 'missing'} does not exist" in found[0][1]
    off = SimpleNamespace(**{**vars(on), "autotune": False})
    assert outputs.problems(off) == []
    good = SimpleNamespace(**{**vars(on), "autotune_log": str(tmp_path / "log.csv")})
    assert outputs.problems(good) == [] and list(tmp_path.iterdir()) == []


def test_a_dropped_follower_stops_following(monkeypatch: pytest.MonkeyPatch) -> None:
    """An optimizer following bucket_bytes through a bound method may be dropped without
    unregistering: autotune then stops trying bucket sizes for it."""
    from hvdlite.diagnostics import autotune as api
    monkeypatch.setattr(api, "FOLLOWERS", {})
    seen: list[int] = []

    class Optimizer:
        def rebucket(self, value: int) -> None:
            seen.append(value)

    optimizer = Optimizer()
    api.follow("bucket_bytes", optimizer.rebucket)
    forget = api.follow("cycle_time", lambda value: seen.append(value))
    for callback in api.followers("bucket_bytes") + api.followers("cycle_time"):
        callback(7)
    assert seen == [7, 7]
    del optimizer
    assert api.followers("bucket_bytes") == [] and len(api.followers("cycle_time")) == 1
    forget()
    assert api.followers("cycle_time") == []


def test_a_failing_search_ends_tuning_on_the_starting_settings(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0's decision is what the other ranks wait for in a broadcast: a search
    that raises must still send one (stop, starting settings), never leave them."""
    from hvdlite.diagnostics import autotune as api
    config = Config.load({}, autotune_warmup_steps=1, autotune_steps_per_sample=1)
    tuner = api.Tuner(config, 0, fixed=set(), planner=lambda observed: 1 / 0)
    decision = tuner._decide([0.5, 0.6])
    assert decision["done"] and decision["trial"] is None
    assert decision["settings"] == tuning.starting_settings(config)
    assert decision["reason"].startswith("autotune failed (ZeroDivisionError")
