"""Timing methods that must not share a process: each method runs in its own
``mpiexec`` launch, rounds interleave the methods (rotating their order), and the
figures are medians with their spread.

Why: on a small shared machine timings drift by 20% from one minute to the next,
so methods timed one after another in one process, or best-of-N, flatter
whichever ran in the quiet moment. Rotating the order within interleaved rounds
spreads the drift over every method alike, and the median with its min-max range
says how much to trust a ratio.

A method is a command (run as ``mpiexec -n NP python -m bench <args>``, or
for the torch transport ``python -m torch.distributed.run --nproc_per_node=NP -m
bench <args>``) whose rank 0 prints one line ``RESULT {json}`` with a numeric
field to compare.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

from hvdlite.runner.gloo import torchrun_here


@dataclass(frozen=True)
class Method:
    label: str
    args: tuple[str, ...]                   # after ``python -m bench``
    env: tuple[tuple[str, str], ...] = ()   # extra environment for this launch
    launcher: str = "mpiexec"               # or "torchrun": hvdlite on the torch transport


@dataclass
class Samples:
    values: list[float] = field(default_factory=list)
    others: dict[str, list[float]] = field(default_factory=dict)   # a result's other fields
    texts: dict[str, list[str]] = field(default_factory=dict)      # ... those that are text

    @property
    def extra(self) -> dict[str, float]:
        """The median of each other numeric field of the results."""
        return {k: statistics.median(v) for k, v in self.others.items() if v}

    @property
    def median(self) -> float:
        return statistics.median(self.values) if self.values else float("nan")

    def spread(self) -> str:
        """The min-max range as a percentage of the median: how far to trust it."""
        if len(self.values) < 2 or not self.median:
            return "   -"
        return f"{100 * (max(self.values) - min(self.values)) / self.median:3.0f}%"


def mpiexec_path() -> str:
    """The venv's own launcher: a system mpiexec may belong to another MPI."""
    return os.path.join(os.path.dirname(sys.executable), "mpiexec")


def command_for(method: Method, np_: int) -> list[str]:
    """The launcher's command line: mpiexec, or torchrun on this host alone."""
    if method.launcher == "torchrun":
        return [*torchrun_here(np_), "-m", "bench", *method.args]
    if method.launcher != "mpiexec":
        raise ValueError(f"unknown launcher {method.launcher!r}: mpiexec or torchrun")
    return [mpiexec_path(), "-n", str(np_), sys.executable, "-m", "bench",
            *method.args]


def launch(method: Method, np_: int, timeout_s: float = 900.0) -> dict:
    """One launch of ``method`` on ``np_`` ranks; its parsed RESULT line."""
    env = dict(os.environ, **dict(method.env))
    command = command_for(method, np_)
    # torchrun's agent leaves a torchelastic_* folder in TMPDIR per job: one of the
    # launch's own, removed after it.
    with tempfile.TemporaryDirectory(prefix="bench-launch-") as scratch:
        if method.launcher == "torchrun":
            env["TMPDIR"] = scratch
        done = subprocess.run(command, capture_output=True, text=True, env=env,
                              timeout=timeout_s, stdin=subprocess.DEVNULL)
    line = next((l for l in done.stdout.splitlines() if l.startswith("RESULT ")), None)
    if done.returncode != 0 or line is None:
        raise RuntimeError(f"{method.label} at np={np_} failed (exit {done.returncode}):\n"
                           f"{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return json.loads(line[len("RESULT "):])


def interleaved(methods: Sequence[Method], np_: int, rounds: int, key: str,
                progress: Optional[str] = None) -> dict[str, Samples]:
    """``rounds`` rounds, each launching every method once, in an order rotated by
    one per round; returns each method's values of ``key``."""
    samples = {m.label: Samples() for m in methods}
    for round_ in range(rounds):
        order = [methods[(i + round_) % len(methods)] for i in range(len(methods))]
        for method in order:
            started = time.monotonic()
            result = launch(method, np_)
            samples[method.label].values.append(float(result[key]))
            for name, value in result.items():
                if name != key and isinstance(value, (int, float)):
                    samples[method.label].others.setdefault(name, []).append(float(value))
                elif isinstance(value, str):
                    samples[method.label].texts.setdefault(name, []).append(value)
            if progress is not None:
                print(f"{progress} np={np_} round {round_ + 1}/{rounds} {method.label}: "
                      f"{samples[method.label].values[-1]:.1f} "
                      f"({time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True)
    return samples


def ratio(a: Samples, b: Samples) -> str:
    """Median ratio a/b, with the range of per-round ratios (rounds pair up in time)."""
    if not b.median:
        return "-"
    paired = [x / y for x, y in zip(a.values, b.values) if y]
    if len(paired) < 2:
        return f"{a.median / b.median:.2f}x"
    return f"{a.median / b.median:.2f}x ({min(paired):.2f}-{max(paired):.2f})"


def worker_parser(methods: Sequence[str], models: Sequence[str]) -> argparse.ArgumentParser:
    """The arguments every benchmark worker takes: which method on which model."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--method", choices=methods, required=True)
    parser.add_argument("--model", choices=models, required=True)
    return parser


def report_rate(comm, samples_per_s: float) -> None:  # type: ignore[no-untyped-def]
    """Rank 0 prints the worker's result as the line ``launch`` reads."""
    if comm.Get_rank() == 0:
        print("RESULT " + json.dumps({"samples_per_s": samples_per_s}), flush=True)
