"""Render jobs/ templates into ready sbatch scripts, so nobody hand-edits them.

    hvdlite-jobs slurm --nodes 2 --gpus-per-node 4 -- python train.py --epochs 3
    hvdlite-jobs slurm --nodes 2 --tasks-per-node 2 -- python train.py
    hvdlite-jobs mpirun --nodes 2 --tasks-per-node 2 -- python train.py
    hvdlite-jobs slurm --elastic --nodes 2 -- python train.py   # requeued on preemption
    hvdlite-jobs srun-mpi        # prints the srun --mpi plugin for the MPI mpi4py loads

The templates are working scripts themselves (``sbatch jobs/slurm_cpu.sbatch python
train.py``); rendering sets their #SBATCH values, the srun plugin (--mpi, default: the
one for the MPI that this Python's mpi4py loads) and bakes in the command.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from pathlib import Path
from typing import Optional, Sequence

from hvdlite.runner.mpi_impl import library


def template_dir() -> Path:
    """jobs/ beside the package (a checkout or editable install), else the copy
    installed under <prefix>/share/hvdlite/jobs."""
    for candidate in (Path(__file__).resolve().parents[2] / "jobs",
                      Path(sys.prefix) / "share" / "hvdlite" / "jobs"):
        if (candidate / "slurm_cpu.sbatch").exists():
            return candidate
    raise FileNotFoundError("hvdlite's jobs/ templates were not found")


def render(kind: str, nodes: int, tasks_per_node: Optional[int], gpus_per_node: int,
           cpus_per_task: Optional[int], job_name: Optional[str], time_limit: Optional[str],
           partition: Optional[str], command: Sequence[str], elastic: bool = False,
           srun_mpi: Optional[str] = None) -> str:
    """The script; ``srun_mpi`` (the srun --mpi plugin) defaults to the one the MPI of
    this Python's mpi4py needs."""
    if elastic:
        if kind != "slurm" or gpus_per_node:
            raise ValueError("--elastic renders the srun CPU template (jobs/slurm_elastic."
                             "sbatch); combine it with neither mpirun nor --gpus-per-node")
        name = "slurm_elastic.sbatch"
    elif kind == "slurm":
        name = "slurm_gpu.sbatch" if gpus_per_node else "slurm_cpu.sbatch"
    else:
        name = "mpirun_allocation.sbatch"
    text = (template_dir() / name).read_text()
    tasks = tasks_per_node or gpus_per_node or 1
    values = {"nodes": str(nodes), "ntasks-per-node": str(tasks)}
    if gpus_per_node:
        values["gres"] = f"gpu:{gpus_per_node}"
    optional = {"cpus-per-task": cpus_per_task, "job-name": job_name, "time": time_limit,
                "partition": partition}
    values.update({k: str(v) for k, v in optional.items() if v is not None})
    for directive, value in values.items():
        text, found = re.subn(rf"^#SBATCH --{directive}=.*$", f"#SBATCH --{directive}={value}",
                              text, flags=re.M)
        if not found:   # add directives the template does not carry (time, partition)
            text = re.sub(r"^(#SBATCH .*\n)(?!#SBATCH)", rf"\1#SBATCH --{directive}={value}\n",
                          text, count=1, flags=re.M)
    if kind == "slurm":
        plugin = srun_mpi or library().srun_mpi
        text, found = re.subn(r'SLURM_MPI_TYPE:-\$\(.*\)\}"', f'SLURM_MPI_TYPE:-{plugin}}}"', text)
        if not found:
            raise ValueError(f"{name} has no SLURM_MPI_TYPE line to set the srun plugin in")
    quoted = " ".join(shlex.quote(part) for part in command)
    return text.replace('"$@"', quoted)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="hvdlite-jobs", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("kind", choices=["slurm", "mpirun", "srun-mpi"],
                        help="slurm: srun starts the ranks; mpirun: hvdliterun inside the "
                             "allocation; srun-mpi: print the srun --mpi plugin this MPI needs")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--tasks-per-node", type=int, help="ranks per node (default: GPUs per node, else 1)")
    parser.add_argument("--gpus-per-node", type=int, default=0, help="one rank per GPU")
    parser.add_argument("--cpus-per-task", type=int)
    parser.add_argument("--job-name")
    parser.add_argument("--time", dest="time_limit", help="e.g. 01:00:00")
    parser.add_argument("--partition")
    parser.add_argument("--mpi", dest="srun_mpi", metavar="PLUGIN",
                        help="srun --mpi plugin, e.g. pmi2 or pmix (default: pmix for Open MPI, "
                             "pmi2 for MPICH, whichever mpi4py loads)")
    parser.add_argument("--elastic", action="store_true",
                        help="requeue on preemption (USR1) and resume (hvd.elastic.run)")
    parser.add_argument("-o", "--output-file", help="write the script here instead of stdout")
    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after "--" is the training command, whatever options it carries.
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    command = argv[split + 1:]
    if args.kind == "srun-mpi":
        print(args.srun_mpi or library().srun_mpi)
        return 0
    if not command:
        parser.error("give the training command after --, e.g. -- python train.py")
    if args.gpus_per_node and args.tasks_per_node and args.tasks_per_node != args.gpus_per_node:
        parser.error("with --gpus-per-node, hvdlite runs one rank per GPU: drop --tasks-per-node "
                     "or make it equal")
    if args.elastic and (args.kind != "slurm" or args.gpus_per_node):
        parser.error("--elastic goes with 'slurm' on CPUs (jobs/slurm_elastic.sbatch)")
    script = render(args.kind, args.nodes, args.tasks_per_node, args.gpus_per_node,
                    args.cpus_per_task, args.job_name, args.time_limit, args.partition, command,
                    args.elastic, args.srun_mpi)
    if args.output_file:
        Path(args.output_file).write_text(script)
        os.chmod(args.output_file, 0o755)
    else:
        sys.stdout.write(script)
    return 0


if __name__ == "__main__":
    sys.exit(main())
