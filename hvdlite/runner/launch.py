"""``hvdliterun``: start a training script on N ranks with the MPI in use.

    hvdliterun -np 4 python train.py --epochs 3
    hvdliterun --gloo -np 2 python train.py      # torchrun and Gloo on this machine, no MPI
    hvdliterun -np 8 -H node1:4,node2:4 --fusion-threshold-mb 32 python train.py
    hvdliterun --check

Knobs given here become HVDLITE_* variables on every rank; the exit code is the job's.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from typing import Optional, Sequence

from hvdlite.errors import ConfigError
from hvdlite.runner import elastic, gloo
from hvdlite.runner.inputs import (check_hostfile, check_number, check_ranks, parse_host_list,
                                   program_problem)
from hvdlite.runner.mpi_impl import (env_arguments, find_launcher, flavor_flags,
                                     hosts_argument, library)
from hvdlite.runner.supervise import Supervisor

# flag -> (HVDLITE_ variable, conversion to the variable's unit)
_KNOBS = {
    "fusion_threshold_mb": ("HVDLITE_FUSION_THRESHOLD", lambda v: f"{v}MiB"),
    "cycle_time_ms": ("HVDLITE_CYCLE_TIME", str),
    "timeline_filename": ("HVDLITE_TIMELINE", str),
    "timeline_mark_cycles": ("HVDLITE_TIMELINE_MARK_CYCLES", lambda v: "1"),
    "stall_check_seconds": ("HVDLITE_STALL_CHECK_TIME", str),
    "stall_shutdown_seconds": ("HVDLITE_STALL_SHUTDOWN_TIME", str),
    "allreduce": ("HVDLITE_ALLREDUCE", str),
    "log_level": ("HVDLITE_LOG_LEVEL", str),
    "report": ("HVDLITE_REPORT", str),
}
# Number flags -> their unit; each must be finite and >= 0 (0 means off where it can).
_NUMBERS = {"fusion_threshold_mb": "MiB", "cycle_time_ms": "milliseconds",
            "stall_check_seconds": "seconds", "stall_shutdown_seconds": "seconds"}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hvdliterun", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("-np", "--num-proc", dest="np", type=int, help="number of ranks")
    p.add_argument("-H", "--hosts", help="host:slots,... (default: this machine)")
    p.add_argument("--hostfile", help="a file of hosts, in the launcher's own format")
    p.add_argument("--fusion-threshold-mb", type=float)
    p.add_argument("--cycle-time-ms", type=float)
    p.add_argument("--timeline-filename")
    p.add_argument("--timeline-mark-cycles", action="store_const", const=True,
                   help="mark each engine cycle (CYCLE_START) on the timeline")
    p.add_argument("--stall-check-seconds", type=float)
    p.add_argument("--stall-shutdown-seconds", type=float)
    p.add_argument("--allreduce", choices=["auto", "mpi", "ring", "ps"])
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    p.add_argument("--report", metavar="DIR",
                   help="write a per-rank balance report (report.txt/json/png) to DIR")
    p.add_argument("--gloo", action="store_true",
                   help="start the ranks on this machine under torchrun, on torch.distributed "
                        "over Gloo instead of MPI (no MPI needed; Horovod's HOROVOD_RANK and "
                        "the rest set on every rank, as horovodrun --gloo does)")
    p.add_argument("--mpiexec", help="launcher to use (default: this Python's, then PATH)")
    p.add_argument("--dry-run", action="store_true", help="print the command, run nothing")
    p.add_argument("--check", action="store_true", help="print what hvdlite can use, and exit")
    elastic.add_arguments(p)
    p.add_argument("command", nargs=argparse.REMAINDER, help="the program and its arguments")
    return p


def knob_variables(args: argparse.Namespace) -> dict[str, str]:
    """The HVDLITE_* variables of the knobs given on the command line."""
    return {var: convert(getattr(args, flag)) for flag, (var, convert) in _KNOBS.items()
            if getattr(args, flag) is not None}


def build_command(args: argparse.Namespace) -> list[str]:
    launcher = find_launcher(args.mpiexec)
    env = knob_variables(args)
    slots = (sum(count for _, count in parse_host_list(args.hosts)) if args.hosts
             else None if args.hostfile else os.cpu_count())
    return ([launcher.path, "-n", str(args.np)] + hosts_argument(launcher.flavor, args.hosts,
                                                                  args.hostfile)
            + flavor_flags(launcher.flavor, args.np, slots)
            + env_arguments(launcher.flavor, env) + list(args.command))


def check_arguments(args: argparse.Namespace) -> None:
    """ConfigError, naming the flag, for an input the launcher would choke or hang on
    (hvdlite.runner.inputs): a rank or slot count out of bounds, a host name that is
    not one, a number that is not finite."""
    check_ranks("-np", args.np)
    if args.hosts is not None:
        parse_host_list(args.hosts)
    if args.hostfile is not None:
        check_hostfile(args.hostfile)
    for flag, unit in _NUMBERS.items():
        if getattr(args, flag) is not None:
            check_number("--" + flag.replace("_", "-"), getattr(args, flag), unit)
    if args.mpiexec is not None and not (os.path.isfile(args.mpiexec)
                                         and os.access(args.mpiexec, os.X_OK)):
        raise ConfigError(f"--mpiexec {args.mpiexec} is not an executable file; give the "
                          "path of an mpiexec or mpirun, or leave --mpiexec out")


def check() -> int:
    """What this installation can use, without starting a job."""
    launcher = find_launcher()
    from mpi4py import MPI   # initializes a singleton MPI: fine in the launcher
    lib = library()
    levels = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
              MPI.THREAD_SERIALIZED: "serialized", MPI.THREAD_MULTIPLE: "multiple"}
    print(f"MPI library:   {lib.version} ({lib.name})")
    print(f"thread level:  {levels.get(MPI.Query_thread(), '?')} (the engine needs at least "
          "serialized; multiple is best)")
    print(f"launcher:      {launcher.path} ({launcher.flavor}: {launcher.version})")
    if launcher.flavor != lib.flavor:
        print(f"               WARNING: this launcher belongs to another MPI than {lib.name}; "
              "pass --mpiexec with the one that matches it")
    print(f"SLURM:         srun --mpi={lib.srun_mpi} (or export SLURM_MPI_TYPE={lib.srun_mpi}); "
          "hvdlite-jobs writes it into its scripts")
    for module in ("torch", "tensorflow", "cupy"):
        found = importlib.util.find_spec(module) is not None
        print(f"{module + ':':14} {'available' if found else 'not installed'}")
    nccl = importlib.util.find_spec("cupy") is not None and importlib.util.find_spec(
        "cupy.cuda.nccl") is not None
    print(f"{'NCCL:':14} " + ("available through CuPy (GPU tensors reduce with NCCL; "
                               "HVDLITE_GPU_ALLREDUCE=mpi stages them instead)" if nccl else
                               "not available (GPU tensors, if any, are staged through host "
                               "memory and MPI)"))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.check:
        return check()
    if args.np is None or not args.command:
        p.error("give -np N and a command, e.g. hvdliterun -np 2 python train.py")
    try:
        check_arguments(args)
        if args.gloo:
            gloo.check(args)
    except ConfigError as exc:
        p.error(str(exc))
    problem = None if args.dry_run or not _ranks_here(args) else program_problem(args.command)
    if problem:
        # As a shell says a command is not found: one line, 127, before any rank starts.
        sys.stderr.write(f"hvdliterun: error: {problem}\n")
        return 127
    if args.gloo:
        return gloo.launch(args.np, args.command, knob_variables(args), args.dry_run)
    elastic.check_arguments(p, args)
    command = build_command(args)
    if args.elastic and not args.dry_run:
        return elastic.run_elastic(args, build_command)
    if args.dry_run:
        print(" ".join(_quote(part) for part in command))
        return 0
    return Supervisor().run(command)


def _ranks_here(args: argparse.Namespace) -> bool:
    """Whether every rank runs on this machine, where its program can be looked for."""
    return not (args.hosts or args.hostfile or args.host_discovery_script)


def _quote(part: str) -> str:
    import shlex
    return shlex.quote(part)


if __name__ == "__main__":
    sys.exit(main())
