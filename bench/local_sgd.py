"""``python -m bench local-sgd``: the loss of the digits example (examples/pytorch_digits.py)
step by step, trained with the gradients averaged every step (DistributedOptimizer) and
with local SGD averaging the models every 1, 4 and 16 steps, each in its own launch at
the same seed; a plot (``--plot``) and the final losses and test accuracies.

Also ``bench training``'s two local SGD methods (``run_hvdlite``, ``run_fused``): its
throughput with the models averaged every PERIOD steps, by hvdlite's
PostLocalSGDOptimizer and by one flat mpi4py Allreduce, its floor."""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Optional, Sequence

from bench.launches import mpiexec_path
from bench.models import build, training_step
from bench.timing import Measured

EXAMPLE = os.path.join("examples", "pytorch_digits.py")
SMOOTHING = 10           # the plot's moving mean, in steps
PERIOD = 8               # bench training's local SGD methods average every PERIOD steps


def run(np_: int, period: int, epochs: int, losses: str) -> tuple[list[float], str]:
    """One launch of the example; (its per-step losses, its last line)."""
    command = [mpiexec_path(), "-n", str(np_), sys.executable, EXAMPLE, "--epochs", str(epochs),
               "--losses", losses, *(["--local-sgd", str(period)] if period else [])]
    done = subprocess.run(command, capture_output=True, text=True, check=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    with open(losses) as source:
        return json.load(source), done.stdout.strip().splitlines()[-1]


def smoothed(values: Sequence[float], window: int = SMOOTHING) -> list[float]:
    """The mean of each value and the ``window - 1`` before it (fewer at the start)."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def plot(curves: dict[str, list[float]], np_: int, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, axes = plt.subplots(figsize=(7, 4))
    for label, losses in curves.items():
        axes.plot(range(1, len(losses) + 1), smoothed(losses), label=label, linewidth=1.4)
    axes.set_xlabel("step")
    axes.set_ylabel(f"training loss (mean over ranks, {SMOOTHING}-step moving mean)")
    axes.set_title(f"digits example, {np_} ranks: averaging gradients or models")
    axes.legend()
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench local-sgd",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--np", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--periods", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--plot", metavar="PNG", help="draw the loss curves here")
    args = parser.parse_args(argv)
    curves: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-local-sgd-") as scratch:
        for period in [0, *args.periods]:
            label = f"local SGD, period {period}" if period else "DistributedOptimizer"
            print(f"{label} ...", file=sys.stderr, flush=True)
            losses, last = run(args.np, period, args.epochs, os.path.join(scratch, "l.json"))
            curves[label] = losses
            accuracy = _accuracy(last)
            tail = losses[-SMOOTHING:]
            print(f"{label:>28}: {len(losses)} steps, final loss {sum(tail) / len(tail):.4f} "
                  f"(mean of the last {len(tail)}), test accuracy {accuracy}", flush=True)
    if args.plot:
        plot(curves, args.np, args.plot)
        print(f"plot: {args.plot}")


def _accuracy(line: str) -> Optional[str]:
    found = re.search(r"test accuracy ([0-9.]+)", line)
    return found.group(1) if found else None


def run_hvdlite(name: str, measured: Measured, seconds: float) -> float:
    import torch
    import hvdlite.torch as hvd
    hvd.init()
    try:
        model, data = build(name)
        sgd = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        optimizer = hvd.PostLocalSGDOptimizer(sgd, hvd.PeriodicModelAverager(PERIOD))
        return measured.timed(training_step(name, model, optimizer, data), seconds)
    finally:
        hvd.shutdown()


def run_fused(name: str, measured: Measured, seconds: float) -> float:
    import numpy as np
    import torch
    from mpi4py import MPI
    comm = measured.comm
    model, data = build(name)
    sgd = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    params = list(model.parameters())
    flat = np.empty(sum(p.numel() for p in params), dtype=np.float32)
    steps = [0]

    def average() -> None:              # after every PERIOD-th step
        steps[0] += 1
        if steps[0] % PERIOD:
            return
        with torch.no_grad():
            torch.cat([p.reshape(-1) for p in params], out=torch.from_numpy(flat))
            started = time.thread_time()
            comm.Allreduce(MPI.IN_PLACE, flat, op=MPI.SUM)
            measured.allreduce_cpu += time.thread_time() - started
            started = time.thread_time()
            np.divide(flat, comm.Get_size(), out=flat)
            measured.average_cpu += time.thread_time() - started
            offset = 0
            for p in params:
                p.copy_(torch.from_numpy(flat[offset:offset + p.numel()]).view_as(p))
                offset += p.numel()
    optimizer = _ThenAfterStep(sgd, average)
    return measured.timed(training_step(name, model, optimizer, data), seconds)


class _ThenAfterStep:
    """An optimizer whose ``step()`` calls ``after()`` once it has stepped."""

    def __init__(self, optimizer: Any, after: Callable[[], None]) -> None:
        self.optimizer, self.after = optimizer, after

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def step(self) -> None:
        self.optimizer.step()
        self.after()
