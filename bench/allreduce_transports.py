"""The allreduce figures on each transport, side by side: hvdlite on MPI (under
mpiexec) and on torch.distributed's Gloo (under torchrun), each beside its transport's
own raw op (mpi4py's; torch.distributed's all_reduce over Gloo, what DDP runs on).

    python -m bench allreduce --transports mpi torch --np 2 --rounds 5

Not itself under a launcher: it launches ``allreduce-worker`` once per transport per
round, interleaved (bench/launches.py), and prints medians with their spread
and the Gloo transport's speed against MPI's hvdlite and against raw Gloo. Figures:
the lone 4-byte op after an idle gap, one large allreduce (``--max-mib``, 64 MiB by
default), and 200 async 4 KiB allreduces.
"""
from __future__ import annotations

import argparse
import json
from typing import Any, Callable, Sequence

import numpy as np

from bench import launches
from bench.timing import lone_median, seconds_per_call
from bench.world import TorchComm, bench_comm, under_torchrun

TRANSPORTS = {"mpi": "mpiexec", "torch": "torchrun"}
# (key, what, unit scale, unit): each figure's row.
FIGURES = (("lone", "lone 4-byte op", 1.0, "us"), ("big", "{mib} MiB", 1e-3, "ms"),
           ("small", "200 x 4 KiB async", 1e-3, "ms"))     # results come in microseconds
IDLE_S = 0.005


def _raw_ops(comm: Any) -> tuple[Callable[[np.ndarray], None],
                                 Callable[[Sequence[np.ndarray]], None]]:
    """The transport's own in-place Sum on one buffer, and on many at once (async)."""
    if isinstance(comm, TorchComm):
        import torch
        import torch.distributed as dist

        def one_gloo(buf: np.ndarray) -> None:
            dist.all_reduce(torch.from_numpy(buf), group=comm.group)

        def many_gloo(bufs: Sequence[np.ndarray]) -> None:
            works = [dist.all_reduce(torch.from_numpy(b), group=comm.group, async_op=True)
                     for b in bufs]
            for work in works:
                work.wait()
        return one_gloo, many_gloo
    from mpi4py import MPI

    def one_mpi(buf: np.ndarray) -> None:
        comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)

    def many_mpi(bufs: Sequence[np.ndarray]) -> None:
        MPI.Request.Waitall([comm.Iallreduce(MPI.IN_PLACE, b, op=MPI.SUM) for b in bufs])
    return one_mpi, many_mpi


def _measure(comm: Any, args: argparse.Namespace) -> dict[str, float]:
    """Every figure, hvdlite's and the raw op's, in microseconds (slowest rank)."""
    import hvdlite as hvd
    one, many = _raw_ops(comm)
    tiny = np.zeros(1, dtype=np.float32)
    big = np.zeros((args.max_mib << 20) // 4, dtype=np.float32)   # zeros: sums stay finite
    small = [np.zeros(1024, dtype=np.float32) for _ in range(200)]

    def two_hundred() -> None:
        handles = [hvd.allreduce_async_(t, op=hvd.Sum, name=f"small.{i}")
                   for i, t in enumerate(small)]
        for handle in handles:
            hvd.synchronize(handle)
    seconds = {
        "lone": lone_median(comm, lambda: hvd.allreduce_(tiny, op=hvd.Sum, name="lone"),
                            args.lone_repeats, IDLE_S),
        "raw_lone": lone_median(comm, lambda: one(tiny), args.lone_repeats, IDLE_S),
        "big": seconds_per_call(lambda: hvd.allreduce_(big, op=hvd.Sum, name="big"),
                                args.seconds, comm),
        "raw_big": seconds_per_call(lambda: one(big), args.seconds, comm),
        "small": seconds_per_call(two_hundred, args.seconds, comm),
        "raw_small": seconds_per_call(lambda: many(small), args.seconds, comm),
    }
    return {key: value * 1e6 for key, value in seconds.items()}


def _options(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--max-mib", type=int, default=64, help="the large op's size (MiB)")
    parser.add_argument("--seconds", type=float, default=0.3, help="timed loop per figure")
    parser.add_argument("--lone-repeats", type=int, default=200, help="lone ops to time")
    return parser


def worker(argv: Sequence[str]) -> None:
    """Under mpiexec or torchrun: every figure on the transport hvdlite opens there;
    rank 0 prints ``RESULT {json}``."""
    import hvdlite as hvd
    args = _options(argparse.ArgumentParser()).parse_args(argv)
    comm = bench_comm()      # torchrun's Gloo group is made here, before hvdlite's world
    hvd.init()
    try:
        result = _measure(comm, args)
        result["transport"] = "torch" if under_torchrun() else "mpi"
    finally:
        hvd.shutdown()
    if comm.Get_rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)


def _methods(transports: Sequence[str], args: argparse.Namespace) -> list[launches.Method]:
    options = ("--max-mib", str(args.max_mib), "--seconds", str(args.seconds),
               "--lone-repeats", str(args.lone_repeats))
    return [launches.Method(name, ("allreduce-worker", *options), (), TRANSPORTS[name])
            for name in transports]


def main(argv: Sequence[str]) -> None:
    parser = _options(argparse.ArgumentParser(prog="python -m bench allreduce",
                                              description=__doc__.split("\n\n")[0]))
    parser.add_argument("--transports", nargs="+", choices=tuple(TRANSPORTS), required=True)
    parser.add_argument("--np", type=int, nargs="+", default=[2])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved launches each")
    args = parser.parse_args(argv)
    for np_ in args.np:
        samples = launches.interleaved(_methods(args.transports, args), np_, args.rounds,
                                       "lone", progress="allreduce")
        print_table(samples, np_, args.rounds, args.max_mib)


def _figure(samples: launches.Samples, key: str) -> launches.Samples:
    """One figure's values over the launches, from a launch's RESULT fields."""
    return launches.Samples(samples.values if key == "lone" else samples.others.get(key, []))


def print_table(samples: dict[str, launches.Samples], np_: int, rounds: int,
                mib: int) -> None:
    columns = [(f"hvdlite {name}", name, "") for name in ("mpi", "torch") if name in samples]
    columns += [(raw, name, "raw_") for raw, name in (("mpi4py", "mpi"), ("torch gloo", "torch"))
                if name in samples]
    print(f"\nAllreduce by transport, np={np_} (float32, Sum, in place; slowest rank). "
          f"Each transport in its own launch (mpi: mpiexec; torch: torchrun), {rounds} "
          "interleaved rounds: median and min-max spread; speed ratios are of medians, "
          "with the range of the per-round ratios. Target (issue 36): the torch "
          "transport within 10% of MPI in training; these are its ops alone.")
    print(f"{'figure':>18} | " + " | ".join(f"{label:>17}" for label, _, _ in columns) +
          " | torch speed vs hvdlite mpi | vs torch gloo")
    for key, what, scale, unit in FIGURES:
        cells = []
        for _, name, prefix in columns:
            figure = _figure(samples[name], prefix + key)
            cells.append(f"{figure.median * scale:9.1f} {unit} {figure.spread():>4}")
        ratios = ["-", "-"]
        if "torch" in samples:
            ours = _figure(samples["torch"], key)
            if "mpi" in samples:
                ratios[0] = launches.ratio(_figure(samples["mpi"], key), ours)
            ratios[1] = launches.ratio(_figure(samples["torch"], "raw_" + key), ours)
        print(f"{what.format(mib=mib):>18} | " + " | ".join(f"{c:>17}" for c in cells) +
              f" | {ratios[0]:>26} | {ratios[1]}")
