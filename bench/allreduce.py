"""Allreduce benchmark: hvdlite's backends against raw mpi4py, in one run.

    mpiexec -n 2 python -m bench allreduce
    python -m bench allreduce --transports mpi torch   # MPI beside Gloo (no mpiexec)

Every figure is the slowest rank's mean time per op over a timed loop of about
``--seconds`` (after warm-up), so ratios compare like with like on the same
machine at the same moment. Bus bandwidth is size * 2(P-1)/P / time, the
per-link traffic of a bandwidth-optimal allreduce (as nccl-tests report it).
"""
from __future__ import annotations

import argparse
import time
from typing import Sequence

import numpy as np
from mpi4py import MPI

import hvdlite as hvd
from bench import gloo
from bench.floor import handoff_floor, lone_median, negotiated_floor
from bench.timing import seconds_per_call
from hvdlite.api import runtime
from hvdlite.api.control import reconfigure
from hvdlite.policy.defaults import describe_bytes
from hvdlite.transport.mpi_library import library_from_version


def _with_backend(name: str, comm: MPI.Comm) -> None:
    reconfigure(allreduce=name)   # negotiated: every rank switches between the same ops


def _size_table(comm: MPI.Comm, sizes: Sequence[int], seconds: float) -> None:
    size = comm.Get_size()
    factor = 2 * (size - 1) / size if size > 1 else 1.0
    say("\nAllreduce (float32, in place): time per op and bus bandwidth\n"
        f"{'size':>9} | {'raw mpi4py':>17} | {'hvdlite mpi':>17} | {'hvdlite ring':>17} | "
        f"{'hvdlite auto':>17} | auto vs raw")
    for nbytes in sizes:
        buf = np.zeros(nbytes // 4, dtype=np.float32)   # zeros: repeated in-place sums stay finite
        cells, times = [], {}
        times["raw"] = seconds_per_call(lambda: comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM), seconds, comm)
        for backend in ("mpi", "ring", "auto"):
            _with_backend(backend, comm)
            times[backend] = seconds_per_call(lambda: hvd.allreduce_(buf, op=hvd.Sum, name="bench"),
                                    seconds, comm)
        for key in ("raw", "mpi", "ring", "auto"):
            busbw = nbytes * factor / times[key] / 1e9
            cells.append(f"{_fmt_time(times[key])} {busbw:6.2f} GB/s")
        say(f"{_fmt_size(nbytes):>9} | " + " | ".join(f"{c:>17}" for c in cells) +
            f" | {times['raw'] / times['auto']:6.2f}x")


def _latency(comm: MPI.Comm, seconds: float) -> None:
    tiny = np.zeros(1, dtype=np.float32)
    raw = seconds_per_call(lambda: comm.Allreduce(MPI.IN_PLACE, tiny, op=MPI.SUM), seconds, comm)
    ours = seconds_per_call(lambda: hvd.allreduce_(tiny, op=hvd.Sum, name="latency"), seconds, comm)
    say(f"\n4-byte allreduce round trip: hvdlite {ours * 1e6:.1f} us, raw mpi4py "
        f"{raw * 1e6:.1f} us (target: hvdlite < 100 us; Horovod 0.28 measured ~1100 us here)")


def _lone_op(comm: MPI.Comm, repeats: int, idle_s: float) -> None:
    """A 4-byte allreduce right after a barrier, after an idle gap: the first gradient
    of a step after compute, when the engine has gone idle. Median over repeats of
    the slowest rank's time, and the engine's idle CPU use; beside it the floor of any
    design where one thread talks to MPI, without and with a negotiation round
    (bench/floor.py)."""
    tiny = np.zeros(1, dtype=np.float32)
    raw = lone_median(comm, lambda: comm.Allreduce(MPI.IN_PLACE, tiny, op=MPI.SUM),
                      repeats, idle_s)
    ours = lone_median(comm, lambda: hvd.allreduce_(tiny, op=hvd.Sum, name="lone"),
                       repeats, idle_s)
    floor = handoff_floor(comm, repeats, idle_s)
    negotiated = negotiated_floor(comm, repeats, idle_s)
    cpu_start, wall_start = time.process_time(), time.perf_counter()
    time.sleep(1.0)          # only the engine runs: its idle cost
    idle = (time.process_time() - cpu_start) / (time.perf_counter() - wall_start)
    idle = comm.allreduce(idle, op=MPI.MAX)
    say(f"\nLone 4-byte allreduce after a barrier and {idle_s * 1e3:.0f} ms idle (median of "
        f"{repeats}): hvdlite {ours * 1e6:.1f} us, raw mpi4py {raw * 1e6:.1f} us (target: "
        f"<= 60 us); idle engine CPU {idle * 100:.1f}% of a core\n"
        f"  floor with one MPI thread (the raw allreduce handed to another thread and back "
        f"through bare locks, no hvdlite): {floor * 1e6:.1f} us; with one agreement round "
        f"before it, as a negotiated op needs: {negotiated * 1e6:.1f} us")
    missing = gloo.missing_reason()
    if missing is None:
        theirs = gloo.lone_op(comm, repeats, idle_s)
        say(f"  torch.distributed over gloo, the same op: {theirs * 1e6:.1f} us "
            f"(hvdlite {theirs / ours:.2f}x its speed)")
    else:
        say(f"  torch.distributed over gloo: skipped, {missing}")


def _set_op(comm: MPI.Comm, repeats: int) -> None:
    """A 4-byte allreduce on a process set of all ranks but the last, while the last
    idles outside hvdlite: every rank joins the global set's rounds, so each op waits
    for the idle rank's engine to tick (HVDLITE_CYCLE_TIME apart while a member has work)."""
    size = comm.Get_size()
    if size < 2:
        say("\nAllreduce on a process set while a rank outside it idles: skipped (needs "
            "2 ranks or more)")
        return
    members = list(range(size - 1))
    cycle_ms = runtime.config().cycle_time    # read now: a peer may shut down before we print
    process_set = hvd.add_process_set(members)
    member_comm = comm.Split(0 if comm.Get_rank() < size - 1 else MPI.UNDEFINED)
    slowest = np.zeros(repeats)
    if member_comm != MPI.COMM_NULL:
        tiny = np.zeros(1, dtype=np.float32)
        for i in range(repeats):
            member_comm.Barrier()
            start = time.perf_counter()
            hvd.allreduce_(tiny, op=hvd.Sum, name="set.op", process_set=process_set)
            slowest[i] = time.perf_counter() - start
        member_comm.Allreduce(MPI.IN_PLACE, slowest, op=MPI.MAX)
        member_comm.Free()
    done = comm.Ibarrier()
    while not done.Test():
        time.sleep(0.001)          # the idle rank: in Python, not spinning inside MPI
    hvd.remove_process_set(process_set)
    if comm.Get_rank() == 0:       # a member: the set holds every rank but the last
        median, p90 = np.median(slowest) * 1e6, np.percentile(slowest, 90) * 1e6
        say(f"\n4-byte allreduce on the set {members} while rank {size - 1} idles (median of "
            f"{repeats}): {median:.0f} us, p90 {p90:.0f} us (HVDLITE_CYCLE_TIME "
            f"{cycle_ms:g} ms)")


def _allocating(comm: MPI.Comm, sizes: Sequence[int], seconds: float) -> None:
    """The form users call, ``out = hvd.allreduce(x)``, which returns a new array,
    against mpi4py's in-place Allreduce and its allocating form."""
    say("\nAllocating allreduce (float32, Sum): out = hvd.allreduce(x) against mpi4py\n"
        f"{'size':>9} | {'raw in place':>12} | {'raw allocating':>14} | {'hvdlite':>10} | "
        "vs in place (target >= 1.0x from 4 MiB, 2x at 64 MiB)")
    for nbytes in sizes:
        x = np.zeros(nbytes // 4, dtype=np.float32)
        in_place = seconds_per_call(lambda: comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM),
                                    seconds, comm)
        allocating = seconds_per_call(
            lambda: comm.Allreduce(x, np.empty_like(x), op=MPI.SUM), seconds, comm)
        ours = seconds_per_call(lambda: hvd.allreduce(x, op=hvd.Sum, name="alloc"),
                                seconds, comm)
        say(f"{_fmt_size(nbytes):>9} | {_fmt_time(in_place):>12} | {_fmt_time(allocating):>14} | "
            f"{_fmt_time(ours):>10} | {in_place / ours:6.2f}x")


def _adasum(comm: MPI.Comm, seconds: float) -> None:
    """Adasum against Sum on the same buffers (power-of-two sizes only)."""
    size = comm.Get_size()
    if size & (size - 1):
        say(f"\nAdasum: skipped (needs a power-of-two number of ranks, not {size})")
        return
    say("\nAdasum vs Sum (float32, out = allreduce(x))\n"
        f"{'size':>9} | {'Sum':>10} | {'Adasum':>10} | Adasum / Sum")
    for nbytes in (1 << 20, 16 << 20):
        x = np.random.default_rng(hvd.rank()).standard_normal(nbytes // 4).astype(np.float32)
        times = {op: seconds_per_call(lambda: hvd.allreduce(x, op=getattr(hvd, op),
                                                            name=f"adasum.{op}"), seconds, comm)
                 for op in ("Sum", "Adasum")}
        say(f"{_fmt_size(nbytes):>9} | {_fmt_time(times['Sum']):>10} | "
            f"{_fmt_time(times['Adasum']):>10} | {times['Adasum'] / times['Sum']:6.2f}x")


def _many_small(comm: MPI.Comm, seconds: float) -> None:
    small = [np.zeros(1024, dtype=np.float32) for _ in range(200)]
    big = np.zeros(200 * 1024, dtype=np.float32)

    def two_hundred() -> None:
        handles = [hvd.allreduce_async_(t, op=hvd.Sum, name=f"small.{i}") for i, t in enumerate(small)]
        for handle in handles:
            hvd.synchronize(handle)

    def grouped() -> None:
        hvd.synchronize(hvd.grouped_allreduce_async_(small, op=hvd.Sum, name="small.grouped"))

    many = seconds_per_call(two_hundred, seconds, comm)
    together = seconds_per_call(grouped, seconds, comm)
    one = seconds_per_call(lambda: hvd.allreduce_(big, op=hvd.Sum, name="one.800k"), seconds, comm)
    say(f"200 x 4 KiB async allreduces: {many * 1e3:.3f} ms; one 800 KiB allreduce: "
        f"{one * 1e3:.3f} ms; ratio {many / one:.2f} (target <= 2; Horovod 0.28: 3.3 ms)")
    say(f"the same 200 as one grouped_allreduce_async_: {together * 1e3:.3f} ms; ratio "
        f"{together / one:.2f}")
    missing = gloo.missing_reason()
    if missing is None:
        gloo_many, gloo_one = gloo.many_small(comm, seconds)
        say(f"torch.distributed over gloo, the same 200 async: {gloo_many * 1e3:.3f} ms; one "
            f"800 KiB: {gloo_one * 1e3:.3f} ms; ratio {gloo_many / gloo_one:.2f} (hvdlite's "
            f"200 {gloo_many / many:.2f}x its speed)")
    else:
        say(f"torch.distributed over gloo: skipped, {missing}")


def _fmt_time(seconds: float) -> str:
    return f"{seconds * 1e3:7.3f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:7.1f} us"


def _fmt_size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def say(text: str) -> None:
    if hvd.rank() == 0:
        print(text, flush=True)


def main(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench allreduce",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-mib", type=int, default=64, help="largest size (MiB)")
    parser.add_argument("--seconds", type=float, default=0.3, help="timed loop per cell")
    parser.add_argument("--lone-repeats", type=int, default=200, help="lone ops to time")
    parser.add_argument("--only", choices=("all", "lone", "set", "allocating", "small", "adasum"),
                        default="all")
    parser.add_argument("--transports", nargs="+", choices=("mpi", "torch"),
                        help="instead, without mpiexec: the lone op, the largest size and "
                             "200 x 4 KiB on each transport side by side (MPI under "
                             "mpiexec, Gloo under torchrun); see allreduce_transports.py")
    args = parser.parse_args(argv)
    hvd.init()
    comm = MPI.COMM_WORLD.Dup()   # the baseline's own communicator
    say(f"hvdlite {hvd.__version__} allreduce benchmark: {hvd.size()} ranks, "
        f"{library_from_version(MPI.Get_library_version()).version}, fusion threshold "
        f"{runtime.config().fusion_threshold >> 20} MiB, ring from "
        f"{describe_bytes(runtime.config().ring_threshold)} in auto")
    sizes = [4 << 10 << (2 * i) for i in range(20) if (4 << 10 << (2 * i)) <= args.max_mib << 20]
    if args.only == "all":
        _size_table(comm, sizes, args.seconds)
        _with_backend("auto", comm)
        _latency(comm, args.seconds)
    if args.only in ("all", "lone"):
        _lone_op(comm, args.lone_repeats, 0.005)
    if args.only in ("all", "set"):
        _set_op(comm, args.lone_repeats)
    if args.only in ("all", "allocating"):
        _allocating(comm, [n for n in sizes if n >= 1 << 20], args.seconds)
    if args.only in ("all", "small"):
        _many_small(comm, args.seconds)
    if args.only in ("all", "adasum"):
        _adasum(comm, args.seconds)
    hvd.shutdown()
