"""Training throughput: hvdlite's DistributedOptimizer against torch DDP over gloo
and a hand-fused mpi4py loop (backward, one flat Allreduce, step), in one run.

    python -m hvdlite.bench training          # runs np=1 and np=2 itself, prints the table

Each method and model runs in its own mpiexec launch, rounds interleave the
methods, and the table gives medians with their spread (hvdlite/bench/launches.py).

One thread per rank (torch.set_num_threads(1)). Samples/s counts the global
batch (per-rank batch x ranks) over timed steps after warm-up.
"""
from __future__ import annotations

import argparse
import os
import tempfile
from typing import Callable, Sequence

from hvdlite.bench import launches
from hvdlite.bench.gloo import gloo_group
from hvdlite.bench.timing import seconds_per_call

MODELS = ("mlp", "cnn")
METHODS = ("hvdlite", "ddp_gloo", "hand_fused")
BATCH = {"mlp": 64, "cnn": 32}   # per rank


def _build(name: str):  # type: ignore[no-untyped-def]
    import torch
    torch.manual_seed(0)
    if name == "mlp":
        model = torch.nn.Sequential(torch.nn.Linear(784, 1024), torch.nn.ReLU(),
                                    torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                                    torch.nn.Linear(1024, 10))
        return model, (torch.randn(64, 784), torch.randint(0, 10, (64,)))
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(64 * 8 * 8, 256), torch.nn.ReLU(),
        torch.nn.Linear(256, 10))
    return model, (torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,)))


def _timed_steps(step: Callable[[], None], seconds: float, comm) -> float:  # type: ignore[no-untyped-def]
    """Training steps per second on the slowest rank."""
    return 1.0 / seconds_per_call(step, seconds, comm, warmup=5, min_calls=10)


def _loop(model, optimizer, data, backward_hook: Callable[[], None] = lambda: None):  # type: ignore[no-untyped-def]
    import torch
    x, y = data

    def step() -> None:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        backward_hook()
        optimizer.step()
    return step


def _run_hand_fused(name: str, comm, seconds: float) -> float:  # type: ignore[no-untyped-def]
    import numpy as np
    import torch
    from mpi4py import MPI
    model, data = _build(name)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    params = list(model.parameters())
    flat = np.empty(sum(p.numel() for p in params), dtype=np.float32)

    def fused_allreduce() -> None:      # after backward: one fused Allreduce, then average
        torch.cat([p.grad.reshape(-1) for p in params], out=torch.from_numpy(flat))
        comm.Allreduce(MPI.IN_PLACE, flat, op=MPI.SUM)
        np.divide(flat, comm.Get_size(), out=flat)
        offset = 0
        for p in params:
            p.grad.copy_(torch.from_numpy(flat[offset:offset + p.numel()]).view_as(p))
            offset += p.numel()
    return _timed_steps(_loop(model, optimizer, data, fused_allreduce), seconds, comm)


def _run_ddp(name: str, comm, seconds: float) -> float:  # type: ignore[no-untyped-def]
    import torch
    with gloo_group(comm):
        model, data = _build(name)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
        return _timed_steps(_loop(ddp, optimizer, data), seconds, comm)


def _run_hvdlite(name: str, comm, seconds: float) -> float:  # type: ignore[no-untyped-def]
    import torch
    import hvdlite.torch as hvd
    hvd.init()
    try:
        model, data = _build(name)
        sgd = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        optimizer = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        return _timed_steps(_loop(model, optimizer, data), seconds, comm)
    finally:
        hvd.shutdown()


def worker(argv: Sequence[str]) -> None:
    """One method on one model, under mpiexec; rank 0 prints ``RESULT {json}``."""
    import torch
    from mpi4py import MPI
    parser = launches.worker_parser(METHODS, MODELS)
    parser.add_argument("--seconds", type=float, default=2.0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD.Dup()
    runners = {"hvdlite": _run_hvdlite, "ddp_gloo": _run_ddp, "hand_fused": _run_hand_fused}
    rate = runners[args.method](args.model, comm, args.seconds) * BATCH[args.model] * comm.Get_size()
    launches.report_rate(comm, rate)


def main(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m hvdlite.bench training",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--np", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--rounds", type=int, default=5, help="interleaved launches per method")
    parser.add_argument("--seconds", type=float, default=2.0, help="timed loop per launch")
    parser.add_argument("--report-cost", action="store_true",
                        help="also run hvdlite with HVDLITE_REPORT set: what recording costs")
    args = parser.parse_args(argv)
    rows = []
    for np_ in args.np:
        for model in args.models:
            def method(label: str, name: str, env: tuple = ()) -> launches.Method:
                return launches.Method(label, ("training-worker", "--method", name, "--model",
                                               model, "--seconds", str(args.seconds)), env)
            methods = [method(m, m) for m in METHODS]
            if args.report_cost:
                methods.append(method("hvdlite_report", "hvdlite", (
                    ("HVDLITE_REPORT", os.path.join(tempfile.gettempdir(), "hvdlite-bench-report")),)))
            rows.append((model, np_, launches.interleaved(
                methods, np_, args.rounds, "samples_per_s", progress=f"training {model}")))
    print(f"\nTraining throughput, samples/s (global batch; one thread per rank; SGD with "
          f"momentum). Each method in its own mpiexec launch, {args.rounds} interleaved "
          "rounds: median, and the min-max spread as % of the median; ratios are of "
          "medians, with the range of the per-round ratios.")
    print(f"{'model':>5} {'np':>3} | {'hvdlite':>13} {'DDP gloo':>13} {'hand-fused':>13} | "
          f"{'vs DDP':>17} {'vs hand-fused':>17}")
    for model, np_, samples in rows:
        cells = " ".join(f"{samples[m].median:7.0f} {samples[m].spread():>5}" for m in METHODS)
        print(f"{model:>5} {np_:>3} | {cells} | "
              f"{launches.ratio(samples['hvdlite'], samples['ddp_gloo']):>17} "
              f"{launches.ratio(samples['hvdlite'], samples['hand_fused']):>17}")
        if "hvdlite_report" in samples:
            print(f"{'':>9} | with HVDLITE_REPORT: {samples['hvdlite_report'].median:7.0f} "
                  f"{samples['hvdlite_report'].spread():>5}, "
                  f"{launches.ratio(samples['hvdlite_report'], samples['hvdlite'])} of hvdlite "
                  "without it (the cost of recording)")
