"""Training throughput: hvdlite's DistributedOptimizer (gradient buckets, and the
per-gradient path for comparison) against torch DDP over gloo (with
``gradient_as_bucket_view=True``) and a hand-fused mpi4py loop (backward, one flat
Allreduce, step), in one run; and the same loop with no exchange at all ("no_comm"):
on a machine whose ranks fill every core, that ceiling bounds what any method can reach.

    python -m hvdlite.bench training          # runs np=1 and np=2 itself, prints the table

Each method and model runs in its own mpiexec launch, rounds interleave the
methods, and the table gives medians with their spread (hvdlite/bench/launches.py).
Beside samples/s: each method's peak resident memory (the largest rank) and its CPU
seconds per step by thread (the training thread, hvdlite's engine, and helper
threads: MPI's, gloo's), read from /proc over the timed steps, averaged over ranks;
for the hand-fused loop also the CPU its Allreduce takes, the bar the engine's CPU
is held to.

One thread per rank (torch.set_num_threads(1)). Samples/s counts the global
batch (per-rank batch x ranks) over timed steps after warm-up.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from typing import Any, Callable, Optional, Sequence

from hvdlite.bench import launches
from hvdlite.bench.gloo import gloo_group
from hvdlite.bench.models import BATCH, MODELS, build, loss
from hvdlite.bench.threads import ThreadClock, peak_rss_mib
from hvdlite.bench.timing import seconds_per_call

METHODS = ("hvdlite", "hvdlite_per_grad", "ddp_gloo", "hand_fused", "no_comm")
# hvdlite_per_grad: hvdlite with buckets off. no_comm: the same loop with no gradient
# exchange at all (each rank trains alone): the ceiling that no method can pass here.
WORKERS = ("hvdlite", "ddp_gloo", "hand_fused", "no_comm")
WARMUP = 5


class Measured:
    """A method's timed loop, with its CPU per thread and (hand-fused) Allreduce CPU."""

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self.clock = ThreadClock()
        self.calls = 0
        self.allreduce_cpu = 0.0
        self.average_cpu = 0.0      # the hand-fused loop's division by the size

    def timed(self, step: Callable[[], None], seconds: float) -> float:
        """Steps per second on the slowest rank; the CPU clock runs over the timed calls."""
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
        return result


def _loop(name: str, model: Any, optimizer: Any, data: Any,
          backward_hook: Callable[[], None] = lambda: None) -> Callable[[], None]:
    def step() -> None:
        optimizer.zero_grad()
        loss(name, model, data).backward()
        backward_hook()
        optimizer.step()
    return step


def _run_hand_fused(name: str, measured: Measured, seconds: float) -> float:
    import numpy as np
    import torch
    from mpi4py import MPI
    comm = measured.comm
    model, data = build(name)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    params = list(model.parameters())
    flat = np.empty(sum(p.numel() for p in params), dtype=np.float32)

    def fused_allreduce() -> None:      # after backward: one fused Allreduce, then average
        torch.cat([p.grad.reshape(-1) for p in params], out=torch.from_numpy(flat))
        started = time.thread_time()
        comm.Allreduce(MPI.IN_PLACE, flat, op=MPI.SUM)
        measured.allreduce_cpu += time.thread_time() - started
        started = time.thread_time()
        np.divide(flat, comm.Get_size(), out=flat)
        measured.average_cpu += time.thread_time() - started
        offset = 0
        for p in params:
            p.grad.copy_(torch.from_numpy(flat[offset:offset + p.numel()]).view_as(p))
            offset += p.numel()
    return measured.timed(_loop(name, model, optimizer, data, fused_allreduce), seconds)


def _run_no_comm(name: str, measured: Measured, seconds: float) -> float:
    import torch
    model, data = build(name)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    return measured.timed(_loop(name, model, optimizer, data), seconds)


def _run_ddp(name: str, measured: Measured, seconds: float) -> float:
    import torch
    with gloo_group(measured.comm):
        model, data = build(name)
        ddp = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
        return measured.timed(_loop(name, ddp, optimizer, data), seconds)


def _run_hvdlite(name: str, measured: Measured, seconds: float) -> float:
    import torch
    import hvdlite.torch as hvd
    hvd.init()
    try:
        model, data = build(name)
        sgd = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        optimizer = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        return measured.timed(_loop(name, model, optimizer, data), seconds)
    finally:
        hvd.shutdown()


def worker(argv: Sequence[str]) -> None:
    """One method on one model, under mpiexec; rank 0 prints ``RESULT {json}``."""
    import torch
    from mpi4py import MPI
    parser = launches.worker_parser(WORKERS, MODELS)
    parser.add_argument("--seconds", type=float, default=2.0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD.Dup()
    runners = {"hvdlite": _run_hvdlite, "ddp_gloo": _run_ddp, "hand_fused": _run_hand_fused,
               "no_comm": _run_no_comm}
    measured = Measured(comm)
    rate = runners[args.method](args.model, measured, args.seconds)
    result = measured.result(rate * BATCH[args.model] * comm.Get_size())
    if comm.Get_rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)


def _methods(model: str, seconds: float, report_dir: Optional[str]) -> list[launches.Method]:
    def method(label: str, name: str, env: tuple = ()) -> launches.Method:
        return launches.Method(label, ("training-worker", "--method", name, "--model", model,
                                       "--seconds", str(seconds)), env)
    methods = [method("hvdlite", "hvdlite"),
               method("hvdlite_per_grad", "hvdlite", (("HVDLITE_BUCKET_BYTES", "0"),)),
               method("ddp_gloo", "ddp_gloo"), method("hand_fused", "hand_fused"),
               method("no_comm", "no_comm")]
    if report_dir is not None:
        methods.append(method("hvdlite_report", "hvdlite", (("HVDLITE_REPORT", report_dir),)))
    return methods


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
    with tempfile.TemporaryDirectory(prefix="hvdlite-bench-report-") as scratch:
        report_dir = scratch if args.report_cost else None    # the reports are not kept
        for np_ in args.np:
            for model in args.models:
                rows.append((model, np_, launches.interleaved(
                    _methods(model, args.seconds, report_dir), np_, args.rounds,
                    "samples_per_s", progress=f"training {model}")))
    _print_table(rows, args.rounds)


def _print_table(rows: list, rounds: int) -> None:
    print(f"\nTraining throughput, samples/s (global batch; one thread per rank; SGD with "
          f"momentum). Each method in its own mpiexec launch, {rounds} interleaved "
          "rounds: median, and the min-max spread as % of the median; ratios are of "
          "medians, with the range of the per-round ratios.")
    print(f"{'model':>11} {'np':>3} | " + " ".join(f"{m:>16}" for m in METHODS) +
          f" | {'bucketed/DDP':>17} {'bucketed/fused':>17} {'per-grad/DDP':>17}"
          f" {'DDP/no-comm':>17} {'bucketed/no-comm':>17}")
    for model, np_, samples in rows:
        cells = " ".join(f"{samples[m].median:9.1f} {samples[m].spread():>5}" for m in METHODS)
        print(f"{model:>11} {np_:>3} | {cells} | "
              f"{launches.ratio(samples['hvdlite'], samples['ddp_gloo']):>17} "
              f"{launches.ratio(samples['hvdlite'], samples['hand_fused']):>17} "
              f"{launches.ratio(samples['hvdlite_per_grad'], samples['ddp_gloo']):>17} "
              f"{launches.ratio(samples['ddp_gloo'], samples['no_comm']):>17} "
              f"{launches.ratio(samples['hvdlite'], samples['no_comm']):>17}")
        if "hvdlite_report" in samples:
            print(f"{'':>15} | with HVDLITE_REPORT: {samples['hvdlite_report'].median:7.0f} "
                  f"{samples['hvdlite_report'].spread():>5}, "
                  f"{launches.ratio(samples['hvdlite_report'], samples['hvdlite'])} of hvdlite "
                  "without it (the cost of recording)")
    print("\nPeak RSS (MiB, largest rank) and CPU ms per step by thread (mean over ranks; "
          "medians over the rounds): training / engine / helpers; hand-fused: its Allreduce "
          "and its division by the size (in the training thread).")
    for model, np_, samples in rows:
        for m in METHODS:
            extra = samples[m].extra
            cpu = " / ".join(f"{1000 * extra.get(f'cpu_{k}', 0.0):7.1f}"
                             for k in ("training", "engine", "helpers"))
            allreduce = (f"  Allreduce {1000 * extra.get('cpu_allreduce', 0.0):6.1f}"
                         f" + average {1000 * extra.get('cpu_average', 0.0):5.1f}"
                         if m == "hand_fused" else "")
            print(f"{model:>11} {np_:>3} {m:>16}: {extra.get('peak_rss_mib', 0.0):7.0f} MiB  "
                  f"cpu {cpu}{allreduce}")
