"""Training throughput: hvdlite's DistributedOptimizer (gradient buckets, and the
per-gradient path for comparison; with its defaults and with HVDLITE_AUTOTUNE)
against torch DDP over gloo (with
``gradient_as_bucket_view=True``) and a hand-fused mpi4py loop (backward, one flat
Allreduce, step), in one run; and the same loop with no exchange at all ("no_comm"):
on a machine whose ranks fill every core, that ceiling bounds what any method can reach.

    python -m bench training          # runs np=1 and np=2 itself, prints the table
    python -m bench training --np 2 4 --models transformer mlp \
        --methods hvdlite autotune ddp_gloo hand_fused no_comm

Each method and model runs in its own mpiexec launch (``hvdlite_gloo``: hvdlite under
torchrun, on the torch transport over Gloo), rounds interleave the
methods, and the table gives medians with their spread (bench/launches.py).
Beside samples/s: each method's peak resident memory (the largest rank) and its CPU
seconds per step by thread (the training thread, hvdlite's engine, and helper
threads: MPI's, gloo's), read from /proc over the timed steps, averaged over ranks;
for the hand-fused loop also the CPU its Allreduce takes, the bar the engine's CPU
is held to.

One thread per rank (torch.set_num_threads(1)). Samples/s counts the global
batch (per-rank batch x ranks) over timed steps after warm-up. ``autotune`` is
hvdlite with HVDLITE_AUTOTUNE=1: it trains until the search has chosen (every rank
learns that at the same step), then is timed like the others on what it chose;
the table says what it chose in each launch and how many steps the search took.
"""
from __future__ import annotations

import argparse
import functools
import json
import tempfile
import time
from typing import Optional, Sequence

from bench import launches, local_sgd
from bench.gloo import gloo_group
from bench.models import BATCH, MODELS, TENSOR_COUNTS, TRAINED, build, training_step
from bench.timing import WARMUP, Measured
from bench.world import bench_comm, under_torchrun

METHODS = ("hvdlite", "hvdlite_negotiated", "hvdlite_gloo", "autotune", "hvdlite_per_grad",
           "ddp_gloo", "hand_fused", "fused_handoff", "fused_negotiated", "local_sgd",
           "fused_local_sgd", "zero", "no_comm")
# The floors (bench/floor.py), local SGD, ZeRO and the lane off run when asked for by name.
DEFAULT_METHODS = tuple(m for m in METHODS
                        if not m.startswith(("fused_", "local_", "hvdlite_negotiated", "zero")))
# hvdlite_gloo: hvdlite with its defaults under torchrun, so on the torch transport (Gloo)
# instead of MPI. hvdlite_negotiated: hvdlite with HVDLITE_LANE=0 (every bucket agreed in a
# negotiation round, as before the lane). hvdlite_per_grad: hvdlite with buckets off. autotune: hvdlite with HVDLITE_AUTOTUNE=1,
# timed after its search. no_comm: the same loop with no gradient exchange at all (each
# rank trains alone): the ceiling that no method can pass here. fused_handoff and
# fused_negotiated: the hand-fused loop with its Allreduce handed to a helper thread, and
# also agreed first in one negotiation round: the floor of any engine that turns a mismatch
# into an error instead of a hang. local_sgd: hvdlite's PostLocalSGDOptimizer, the models
# averaged every bench.local_sgd.PERIOD steps instead of the gradients every step;
# fused_local_sgd: its floor, the no_comm loop with the parameters averaged as often by
# one flat mpi4py Allreduce (a wait for the slowest rank every period included). zero:
# hvdlite's ZeroRedundancyOptimizer over the same SGD, its state sharded across the ranks.
# Ratios printed where both methods ran: (label, numerator, denominator).
RATIOS = (("defaults/fused", "hvdlite", "hand_fused"), ("autotune/fused", "autotune", "hand_fused"),
          ("autotune/defaults", "autotune", "hvdlite"), ("defaults/DDP", "hvdlite", "ddp_gloo"),
          ("defaults/no-comm", "hvdlite", "no_comm"), ("autotune/no-comm", "autotune", "no_comm"),
          ("per-grad/DDP", "hvdlite_per_grad", "ddp_gloo"), ("DDP/no-comm", "ddp_gloo", "no_comm"),
          ("negotiated/fused", "fused_negotiated", "hand_fused"),
          ("defaults/negotiated", "hvdlite", "fused_negotiated"),
          ("lane/lane-off", "hvdlite", "hvdlite_negotiated"),
          ("lane-off/fused", "hvdlite_negotiated", "hand_fused"),
          ("local-sgd/no-comm", "local_sgd", "no_comm"),
          ("local-sgd/defaults", "local_sgd", "hvdlite"),
          ("local-sgd/fused", "local_sgd", "fused_local_sgd"),
          ("fused-local-sgd/no-comm", "fused_local_sgd", "no_comm"),
          ("zero/defaults", "zero", "hvdlite"),
          ("gloo-transport/MPI", "hvdlite_gloo", "hvdlite"),
          ("gloo-transport/DDP", "hvdlite_gloo", "ddp_gloo"))
WORKERS = ("hvdlite", "ddp_gloo", "hand_fused", "fused_handoff", "fused_negotiated", "local_sgd",
           "fused_local_sgd", "zero", "no_comm")
def _run_hand_fused(name: str, measured: Measured, seconds: float,
                    floor: str = "") -> float:
    """The hand-fused loop; ``floor`` "handoff" or "negotiated": its Allreduce run by a
    helper thread, after an agreement round for "negotiated" (bench/floor.py)."""
    import numpy as np
    import torch
    from mpi4py import MPI
    from bench import floor as floors
    comm = measured.comm
    model, data = build(name)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    params = list(model.parameters())
    flat = np.empty(sum(p.numel() for p in params), dtype=np.float32)
    private = comm.Dup() if floor else comm
    agree = floors.Agreement(private) if floor == "negotiated" else None

    def reduce() -> None:               # the CPU of whichever thread runs it
        started = time.thread_time()
        if agree is not None:
            agree.run()
        private.Allreduce(MPI.IN_PLACE, flat, op=MPI.SUM)
        measured.allreduce_cpu += time.thread_time() - started
    helper = floors.Helper(reduce) if floor else None
    exchange = helper.run if helper is not None else reduce

    def fused_allreduce() -> None:      # after backward: one fused Allreduce, then average
        torch.cat([p.grad.reshape(-1) for p in params], out=torch.from_numpy(flat))
        exchange()
        started = time.thread_time()
        np.divide(flat, comm.Get_size(), out=flat)
        measured.average_cpu += time.thread_time() - started
        offset = 0
        for p in params:
            p.grad.copy_(torch.from_numpy(flat[offset:offset + p.numel()]).view_as(p))
            offset += p.numel()
    try:
        return measured.timed(training_step(name, model, optimizer, data, fused_allreduce), seconds)
    finally:
        if helper is not None:
            helper.close()
        if agree is not None:
            agree.free()
        if floor:
            private.Free()


def _run_no_comm(name: str, measured: Measured, seconds: float) -> float:
    import torch
    model, data = build(name)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    return measured.timed(training_step(name, model, optimizer, data), seconds)


def _run_ddp(name: str, measured: Measured, seconds: float) -> float:
    import torch
    with gloo_group(measured.comm):
        model, data = build(name)
        ddp = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
        return measured.timed(training_step(name, ddp, optimizer, data), seconds)


def _run_zero(name: str, measured: Measured, seconds: float) -> float:
    import torch
    import hvdlite.torch as hvd
    hvd.init()
    try:
        model, data = build(name)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        optimizer = hvd.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.01,
                                                momentum=0.9)
        return measured.timed(training_step(name, model, optimizer, data), seconds)
    finally:
        hvd.shutdown()


def _run_hvdlite(name: str, measured: Measured, seconds: float) -> float:
    import torch
    import hvdlite.torch as hvd
    from hvdlite.diagnostics import autotune
    hvd.init()
    try:
        model, data = build(name)
        sgd = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        optimizer = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        step = training_step(name, model, optimizer, data)
        started = time.perf_counter()
        while not autotune.finished():     # HVDLITE_AUTOTUNE: every rank stops at one step
            step()
            measured.tuning_steps += 1
        measured.tuning_s = time.perf_counter() - started
        current = autotune.tuner()
        if current is not None:
            from hvdlite.policy.tuning import describe
            measured.choice = describe(current.changes()) or "defaults"
        return measured.timed(step, seconds, since=started)
    finally:
        hvd.shutdown()


def worker(argv: Sequence[str]) -> None:
    """One method on one model, under mpiexec (hvdlite under torchrun too: the torch
    transport); rank 0 prints ``RESULT {json}``."""
    import torch
    parser = launches.worker_parser(WORKERS, MODELS)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--warmup-seconds", type=float, default=0.0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if under_torchrun() and args.method != "hvdlite":
        raise SystemExit(f"{args.method} runs under mpiexec; under torchrun only hvdlite")
    comm = bench_comm()
    runners = {"hvdlite": _run_hvdlite, "ddp_gloo": _run_ddp, "hand_fused": _run_hand_fused,
               "fused_handoff": functools.partial(_run_hand_fused, floor="handoff"),
               "fused_negotiated": functools.partial(_run_hand_fused, floor="negotiated"),
               "local_sgd": local_sgd.run_hvdlite, "fused_local_sgd": local_sgd.run_fused,
               "zero": _run_zero, "no_comm": _run_no_comm}
    measured = Measured(comm, args.warmup_seconds)
    rate = runners[args.method](args.model, measured, args.seconds)
    result = measured.result(rate * BATCH[args.model] * comm.Get_size())
    if comm.Get_rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)


# glibc malloc's tunables; setting them turns its dynamic mmap threshold off. Left dynamic,
# a step's large activations are mapped and unmapped each step (page faults in forward) or
# not, depending on which large blocks the process happened to free earlier: 7% between
# two launches of the same code (BENCHMARKS.md, "where the 7% between the trees goes").
PINNED_MALLOC = (("MALLOC_MMAP_THRESHOLD_", "134217728"), ("MALLOC_TRIM_THRESHOLD_", "268435456"))


def _methods(model: str, seconds: float, report_dir: Optional[str],
             chosen: Sequence[str] = DEFAULT_METHODS, warmup_s: float = 0.0,
             pin_malloc: bool = False) -> list[launches.Method]:
    def method(label: str, name: str, env: tuple = (),
               launcher: str = "mpiexec") -> launches.Method:
        return launches.Method(label, ("training-worker", "--method", name, "--model", model,
                                       "--seconds", str(seconds),
                                       "--warmup-seconds", str(warmup_s)),
                               env + (PINNED_MALLOC if pin_malloc else ()), launcher)
    every = {"hvdlite": method("hvdlite", "hvdlite"),
             "hvdlite_negotiated": method("hvdlite_negotiated", "hvdlite",
                                          (("HVDLITE_LANE", "0"),)),
             "hvdlite_gloo": method("hvdlite_gloo", "hvdlite", launcher="torchrun"),
             "autotune": method("autotune", "hvdlite", (("HVDLITE_AUTOTUNE", "1"),)),
             "hvdlite_per_grad": method("hvdlite_per_grad", "hvdlite",
                                        (("HVDLITE_BUCKET_BYTES", "0"),)),
             "ddp_gloo": method("ddp_gloo", "ddp_gloo"),
             "hand_fused": method("hand_fused", "hand_fused"),
             "fused_handoff": method("fused_handoff", "fused_handoff"),
             "fused_negotiated": method("fused_negotiated", "fused_negotiated"),
             "local_sgd": method("local_sgd", "local_sgd"),
             "fused_local_sgd": method("fused_local_sgd", "fused_local_sgd"),
             "zero": method("zero", "zero"),
             "no_comm": method("no_comm", "no_comm")}
    methods = [every[name] for name in METHODS if name in chosen]
    if report_dir is not None:
        methods.append(method("hvdlite_report", "hvdlite", (("HVDLITE_REPORT", report_dir),)))
    return methods


def main(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench training",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--np", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(TRAINED))
    parser.add_argument("--tensors", action="store_true",
                        help="the engine's CPU per step against the number of gradient "
                             "tensors: the tensors10/100/1000 models (16 MiB of gradients "
                             "each), hvdlite and the hand-fused loop unless --methods names "
                             "others")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(DEFAULT_METHODS),
                        help="which methods to launch (default: all but the floors, "
                             "fused_handoff and fused_negotiated)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved launches per method")
    parser.add_argument("--seconds", type=float, default=2.0, help="timed loop per launch")
    parser.add_argument("--warmup-seconds", type=float, default=0.0,
                        help="every method trains this long, untimed, before its timed loop "
                             "(autotune: its search counts, and it trains on until both are "
                             "done); set it above autotune's search time to compare autotune "
                             "and the defaults after the same time in training (default: 0, "
                             "only the first 5 steps)")
    parser.add_argument("--pin-malloc", action="store_true",
                        help="every launch with glibc malloc's mmap and trim thresholds "
                             "pinned (MALLOC_MMAP_THRESHOLD_=128 MiB, "
                             "MALLOC_TRIM_THRESHOLD_=256 MiB): no method's speed then "
                             "depends on which large blocks it freed first")
    parser.add_argument("--report-cost", action="store_true",
                        help="also run hvdlite with HVDLITE_REPORT set: what recording costs")
    args = parser.parse_args(argv)
    if args.tensors:
        args.models = list(TENSOR_COUNTS)
        if "--methods" not in argv:
            args.methods = ["hvdlite", "hand_fused"]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-report-") as scratch:
        report_dir = scratch if args.report_cost else None    # the reports are not kept
        for np_ in args.np:
            for model in args.models:
                rows.append((model, np_, launches.interleaved(
                    _methods(model, args.seconds, report_dir, args.methods, args.warmup_seconds,
                             args.pin_malloc),
                    np_, args.rounds,
                    "samples_per_s", progress=f"training {model}")))
    _print_table(rows, args.rounds, args.warmup_seconds, args.pin_malloc)
    if any(model in TENSOR_COUNTS for model, _, _ in rows):
        _print_tensors_table(rows)


def _print_table(rows: list, rounds: int, warmup_s: float = 0.0,
                 pin_malloc: bool = False) -> None:
    warmup = (f"after {warmup_s:g} s of untimed training (autotune: and its search)"
              if warmup_s > 0 else f"after {WARMUP} steps (autotune: after its search)")
    allocator = ("glibc malloc's thresholds pinned" if pin_malloc
                 else "glibc malloc's dynamic thresholds")
    print(f"\nTraining throughput, samples/s (global batch; one thread per rank; SGD with "
          f"momentum; {allocator}), timed {warmup}. Each method in its own mpiexec launch "
          f"(hvdlite_gloo: torchrun, hvdlite on the torch transport), {rounds} interleaved "
          "rounds: median, and the "
          "min-max spread as % of the median; ratios are of medians, with the range of "
          "the per-round ratios.")
    for model, np_, samples in rows:
        methods = [m for m in METHODS if m in samples]
        print(f"\n{model} np={np_}")
        for m in methods:
            print(f"  {m:>16}: {samples[m].median:9.1f} {samples[m].spread():>5}  "
                  f"{[round(v, 1) for v in samples[m].values]}")
        for label, a, b in RATIOS:
            if a in samples and b in samples:
                print(f"  {label:>18}: {launches.ratio(samples[a], samples[b])}")
        if "hvdlite_gloo" in samples:
            print("  (targets for the torch transport, issue 36: gloo-transport/MPI >= "
                  "0.90x; gloo-transport/DDP > 1.00x on the transformer)")
        if "autotune" in samples:
            tuned = samples["autotune"]
            print(f"  autotune chose, per launch: {tuned.texts.get('choice', [])}; search "
                  f"{tuned.extra.get('tuning_steps', 0):.0f} steps, "
                  f"{tuned.extra.get('tuning_s', 0.0):.1f} s (medians)")
        if "hvdlite_report" in samples and "hvdlite" in samples:
            print(f"  with HVDLITE_REPORT: {samples['hvdlite_report'].median:7.0f} "
                  f"{samples['hvdlite_report'].spread():>5}, "
                  f"{launches.ratio(samples['hvdlite_report'], samples['hvdlite'])} of hvdlite "
                  "without it (the cost of recording)")
    print("\nPeak RSS (MiB, largest rank) and CPU ms per step by thread (mean over ranks; "
          "medians over the rounds): training / engine / helpers; hand-fused: its Allreduce "
          "and its division by the size (in the training thread).")
    for model, np_, samples in rows:
        for m in [m for m in METHODS if m in samples]:
            extra = samples[m].extra
            cpu = " / ".join(f"{1000 * extra.get(f'cpu_{k}', 0.0):7.1f}"
                             for k in ("training", "engine", "helpers"))
            allreduce = (f"  Allreduce {1000 * extra.get('cpu_allreduce', 0.0):6.1f}"
                         f" + average {1000 * extra.get('cpu_average', 0.0):5.1f}"
                         if m.startswith(("hand_", "fused_")) else "")
            print(f"{model:>11} {np_:>3} {m:>16}: {extra.get('peak_rss_mib', 0.0):7.0f} MiB  "
                  f"cpu {cpu}{allreduce}")


def _print_tensors_table(rows: list) -> None:
    """The engine's CPU per step against the number of tensors and the world size, beside
    the hand-fused loop's own Allreduce of the same bytes in one piece."""
    print("\nEngine CPU per step against the number of gradient tensors (4 Mi float32 in "
          "all, split evenly), ms (mean over ranks, median over rounds), beside the "
          "hand-fused loop's Allreduce of the same bytes in one buffer:")
    print(f"{'np':>3} {'tensors':>8} {'engine':>8} {'Allreduce':>10} {'engine/Allreduce':>17}")
    for model, np_, samples in rows:
        if model not in TENSOR_COUNTS or "hvdlite" not in samples:
            continue
        engine = 1000 * samples["hvdlite"].extra.get("cpu_engine", 0.0)
        fused = (1000 * samples["hand_fused"].extra.get("cpu_allreduce", 0.0)
                 if "hand_fused" in samples else 0.0)
        ratio = f"{engine / fused:16.2f}x" if fused > 0 else f"{'-':>17}"
        print(f"{np_:>3} {TENSOR_COUNTS[model]:>8} {engine:8.2f} {fused:10.2f} {ratio}")
