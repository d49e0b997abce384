"""``python -m bench training --methods ...``: the launches it makes (autotune
is hvdlite with HVDLITE_AUTOTUNE=1), and a table over whichever methods ran, with the
choice autotune made in each launch. No benchmark runs here: the launches are stood in
for."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Optional

import pytest

from bench import launches, timing, training


def test_methods_picks_the_launches_and_autotune_turns_autotune_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[str, tuple, int]] = []

    def interleaved(methods: list, np_: int, rounds: int, metric: str, progress: str) -> Any:
        seen.extend((m.label, m.env, np_) for m in methods)
        return {}

    monkeypatch.setattr(training.launches, "interleaved", interleaved)
    monkeypatch.setattr(training, "_print_table", lambda *table: None)
    training.main(["--np", "2", "4", "--models", "mlp", "--methods", "no_comm", "autotune",
                   "hvdlite", "hand_fused", "ddp_gloo"])
    labels = [label for label, _, np_ in seen if np_ == 2]
    assert labels == ["hvdlite", "autotune", "ddp_gloo", "hand_fused", "no_comm"]
    envs = {label: dict(env) for label, env, _ in seen}
    assert envs["autotune"] == {"HVDLITE_AUTOTUNE": "1"} and envs["hvdlite"] == {}
    assert [np_ for _, _, np_ in seen] == [2] * 5 + [4] * 5


def test_the_floors_run_only_when_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """fused_handoff and fused_negotiated (the hand-fused loop through a helper thread,
    and after a negotiation round) are for the analysis, not every run."""
    seen: list[list[str]] = []
    monkeypatch.setattr(training.launches, "interleaved",
                        lambda methods, *rest, **kw: seen.append([m.label for m in methods]))
    monkeypatch.setattr(training, "_print_table", lambda *table: None)
    training.main(["--np", "2", "--models", "mlp"])
    training.main(["--np", "2", "--models", "mlp", "--methods", "fused_negotiated",
                   "hand_fused", "fused_handoff"])
    assert not any(label.startswith("fused_") for label in seen[0])
    assert seen[1] == ["hand_fused", "fused_handoff", "fused_negotiated"]


def test_the_table_shows_the_ratios_of_what_ran_and_what_autotune_chose(
        capsys: pytest.CaptureFixture) -> None:
    def samples(values: list[float], **others: Any) -> launches.Samples:
        texts = {k: v for k, v in others.items() if isinstance(v[0], str)}
        numbers = {k: v for k, v in others.items() if k not in texts}
        return launches.Samples(values, numbers, texts)
    rows = [("mlp", 2, {"hvdlite": samples([100.0, 110.0]),
                        "autotune": samples([120.0, 100.0], tuning_steps=[60.0, 80.0],
                                            tuning_s=[3.0, 5.0],
                                            choice=["ring_threshold=never", "defaults"]),
                        "hand_fused": samples([100.0, 100.0])})]
    training._print_table(rows, 2)
    out = capsys.readouterr().out
    assert "defaults/fused: 1.05x (1.00-1.10)" in out
    assert "autotune/fused: 1.10x (1.00-1.20)" in out
    assert "autotune/defaults: 1.05x (0.91-1.20)" in out
    assert "DDP" not in out.split("Peak RSS")[0]          # DDP did not run: no ratio
    assert ("autotune chose, per launch: ['ring_threshold=never', 'defaults']; search 70 "
            "steps, 4.0 s (medians)") in out


def test_warmup_seconds_reaches_every_launch_and_the_heading(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    args: list[tuple] = []

    def interleaved(methods: list, np_: int, rounds: int, metric: str, progress: str) -> Any:
        args.extend(m.args for m in methods)
        return {}

    monkeypatch.setattr(training.launches, "interleaved", interleaved)
    training.main(["--np", "2", "--models", "mlp", "--methods", "hvdlite", "autotune",
                   "--warmup-seconds", "7"])
    assert args and all(a[a.index("--warmup-seconds") + 1] == "7.0" for a in args), args
    assert "timed after 7 s of untimed training" in capsys.readouterr().out


@pytest.mark.parametrize("flag,pinned", [([], False), (["--pin-malloc"], True)])
def test_pin_malloc_reaches_every_launch_and_the_heading(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, flag: list[str],
        pinned: bool) -> None:
    envs: list[dict] = []

    def interleaved(methods: list, np_: int, rounds: int, metric: str, progress: str) -> Any:
        envs.extend(dict(m.env) for m in methods)
        return {}

    monkeypatch.setattr(training.launches, "interleaved", interleaved)
    training.main(["--np", "2", "--models", "mlp", "--methods", "hvdlite", "autotune",
                   "hand_fused", "no_comm", *flag])
    assert len(envs) == 4
    assert all(("MALLOC_MMAP_THRESHOLD_" in env) == pinned for env in envs), envs
    assert all(("MALLOC_TRIM_THRESHOLD_" in env) == pinned for env in envs), envs
    assert envs[1]["HVDLITE_AUTOTUNE"] == "1"          # a method's own setting stays
    heading = capsys.readouterr().out
    assert ("malloc's thresholds pinned" in heading) == pinned, heading


class OneRank:
    """A communicator of one rank; ``told``, where given, are rank 0's answers to the
    warm-up's question (is it over?) as another rank receives them."""

    def __init__(self, told: Optional[list[bool]] = None) -> None:
        self.told = told

    def bcast(self, value: Any, root: int) -> Any:
        assert root == 0
        return self.told.pop(0) if self.told is not None else value

    def Barrier(self) -> None:
        pass

    def allgather(self, value: Any) -> list:
        return [value]


def _clocked(monkeypatch: pytest.MonkeyPatch, measured: training.Measured) -> Any:
    """A step on a fake clock: an untimed step takes 1 s, a timed one (counted by
    ``measured``) 0.1 s; returns the step and the calls count each step saw."""
    now = [0.0]
    seen: list[int] = []
    clock = SimpleNamespace(perf_counter=lambda: now[0])
    monkeypatch.setattr(training, "time", clock)
    monkeypatch.setattr(timing, "time", clock)

    def step() -> None:
        seen.append(measured.calls)
        now[0] += 1.0 if measured.calls == 0 else 0.1
    return step, seen


def test_a_worker_trains_untimed_for_the_seconds_asked_then_times_only_what_follows(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """--warmup-seconds on a fake clock, so no machine is too slow or too busy for it:
    2.5 s of 1 s steps is three untimed steps, and the rate is the timed steps' alone."""
    measured = training.Measured(OneRank(), warmup_s=2.5)
    step, seen = _clocked(monkeypatch, measured)
    rate = measured.timed(step, seconds=1.0)
    assert measured.warmup_steps == 3 and seen[:4] == [0, 0, 0, 1], seen
    assert rate == pytest.approx(10.0)                 # 0.1 s a step: no warm-up step in it
    assert measured.result(rate)["warmup_steps"] == 3


def test_every_rank_ends_its_warm_up_when_rank_0_says(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank whose own clock says the warm-up is over keeps training until rank 0's does."""
    measured = training.Measured(OneRank(told=[False, False, True]), warmup_s=0.5)
    step, seen = _clocked(monkeypatch, measured)
    measured.warm_up(step, since=-100.0)
    assert measured.warmup_steps == 2 and seen == [0, 0]


def test_tensors_runs_the_split_models_with_hvdlite_and_the_fused_loop(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """``--tensors``: the same 16 MiB of gradients in 10, 100 and 1,000 tensors, and a table
    of the engine's CPU per step beside the hand-fused loop's Allreduce."""
    seen: list[tuple[str, list[str]]] = []

    def interleaved(methods: list, np_: int, rounds: int, metric: str, progress: str) -> Any:
        model = methods[0].args[methods[0].args.index("--model") + 1]
        seen.append((model, [m.label for m in methods]))
        cpu = {"hvdlite": {"cpu_engine": [0.012]}, "hand_fused": {"cpu_allreduce": [0.008]}}
        return {m.label: launches.Samples([1.0], cpu[m.label], {}) for m in methods}

    monkeypatch.setattr(training.launches, "interleaved", interleaved)
    training.main(["--np", "2", "--tensors"])
    assert seen == [(name, ["hvdlite", "hand_fused"])
                    for name in ("tensors10", "tensors100", "tensors1000")]
    table = capsys.readouterr().out.split("Engine CPU per step")[1]
    assert "  2     1000    12.00       8.00             1.50x" in table


def test_the_split_models_hold_the_same_parameters_in_that_many_tensors() -> None:
    torch = pytest.importorskip("torch")
    from bench import models
    for name, count in models.TENSOR_COUNTS.items():
        model, data = models.build(name)
        params = list(model.parameters())
        assert len(params) == count and sum(p.numel() for p in params) == models.TENSOR_ELEMENTS
        models.loss(name, model, data).backward()
        assert all(torch.equal(p.grad, torch.ones_like(p)) for p in params)
