"""``hvdliterun --gloo``: the ranks on this machine under torchrun, on the torch transport
(torch.distributed over Gloo), where no MPI is installed; Horovod's ``horovodrun --gloo``.

torchrun numbers the ranks and gives each its place in ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``...; each rank then starts through this module, which also sets Horovod's
names for them (``HOROVOD_RANK``, ``HOROVOD_SIZE``...), as ``horovodrun --gloo`` sets them
for its workers, and runs the command in its place. Several machines: one torchrun per
machine (docs/guide/transports.md).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import shutil
import sys
import tempfile
from typing import Mapping, Sequence

from hvdlite.errors import ConfigError

# Horovod's launcher variable <- torchrun's (the cross rank and size: the node's index and
# the number of nodes, each with the same number of ranks under --nproc_per_node).
_HOROVOD_NAMES = {"HOROVOD_RANK": "RANK", "HOROVOD_SIZE": "WORLD_SIZE",
                  "HOROVOD_LOCAL_RANK": "LOCAL_RANK", "HOROVOD_LOCAL_SIZE": "LOCAL_WORLD_SIZE",
                  "HOROVOD_CROSS_RANK": "GROUP_RANK"}


def torchrun_here(np: int) -> list[str]:
    """torchrun for ``np`` ranks on this machine alone, run as a module of this Python so
    that the ranks are too (a torchrun on PATH may belong to another environment).
    --standalone: its store binds a port of the kernel's choosing; a port picked free
    beforehand can be taken by another connection first (EADDRINUSE)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={np}"]


def command(np: int, program: Sequence[str]) -> list[str]:
    """torchrun on this machine, ``np`` ranks, each starting ``program`` through this
    module (``--no-python``: the program is run as given, ``python train.py`` or not).
    torchrun runs through hvdlite.runner.torchrun, so that the job's exit code is the
    failed rank's, not torchrun's 1."""
    return [sys.executable, "-m", "hvdlite.runner.torchrun", *torchrun_here(np)[3:],
            "--no-python", sys.executable, "-m", "hvdlite.runner.gloo", *program]


def check(args: argparse.Namespace) -> None:
    """ConfigError for what --gloo cannot do: other machines, elastic jobs, an mpiexec."""
    for flag, given in (("-H", args.hosts), ("--hostfile", args.hostfile),
                        ("--mpiexec", args.mpiexec)):
        if given is not None:
            raise ConfigError(
                f"hvdliterun --gloo starts its ranks on this machine only, so {flag} has no "
                "meaning there; on several machines start one torchrun per machine "
                "(docs/guide/transports.md, 'torchrun on several machines'), or leave --gloo "
                "out to launch with MPI")
    if args.elastic:
        raise ConfigError("hvdliterun --gloo has no --elastic: under torchrun, restarts are "
                          "torchrun's own (torchrun --nnodes=MIN:MAX --max-restarts=N, "
                          "docs/guide/transports.md); or leave --gloo out")
    if importlib.util.find_spec("torch") is None:
        raise ConfigError("hvdliterun --gloo runs the ranks on torch.distributed, and torch "
                          "is not installed for this Python: pip install torch, or leave "
                          "--gloo out to launch with MPI")


def launch(np: int, program: Sequence[str], settings: Mapping[str, str],
           dry_run: bool) -> int:
    """Run the job (the knobs' HVDLITE_* variables in every rank's environment); its exit
    code. torchrun leaves a torchelastic_* folder in TMPDIR for every job: it gets a
    folder of its own under TMPDIR, removed after the job."""
    from hvdlite.runner.supervise import Supervisor
    variables = [f"{name}={value}" for name, value in sorted(settings.items())]
    if dry_run:
        print(shlex.join((["env", *variables] if variables else []) + command(np, program)))
        return 0
    scratch = tempfile.mkdtemp(prefix="hvdliterun-gloo-")
    try:
        return Supervisor().run(["env", *variables, f"TMPDIR={scratch}",
                                 *command(np, program)], scratch=[scratch])
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def horovod_variables(environ: Mapping[str, str]) -> dict[str, str]:
    """Horovod's launcher variables for this rank, from torchrun's."""
    values = {name: environ[source] for name, source in _HOROVOD_NAMES.items()
              if source in environ}
    if "WORLD_SIZE" in environ and "LOCAL_WORLD_SIZE" in environ:
        values["HOROVOD_CROSS_SIZE"] = str(int(environ["WORLD_SIZE"])
                                           // max(1, int(environ["LOCAL_WORLD_SIZE"])))
    return values


def main(argv: Sequence[str]) -> None:
    """A rank under torchrun: Horovod's variables set, then the program in its place."""
    if not argv:
        sys.exit("usage: python -m hvdlite.runner.gloo PROGRAM [ARGS...] (under torchrun)")
    os.environ.update(horovod_variables(os.environ))
    try:
        os.execvp(argv[0], list(argv))
    except OSError as exc:      # one line, as a shell says it, not a traceback
        sys.stderr.write(f"hvdliterun --gloo: rank {os.environ.get('RANK', '?')} could not "
                         f"start {argv[0]}: {exc.strerror or exc}\n")
        sys.exit(127)


if __name__ == "__main__":
    main(sys.argv[1:])
