"""How whole-job tests start MPI: this venv's mpiexec with the flags its MPI needs
(Open MPI: run as root, more ranks than cores), and the name of that MPI for test
ids. Nothing here initializes MPI in the test process."""
from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

from hvdlite.runner.mpi_impl import Launcher, Library, find_launcher, flavor_flags, library

MPIEXEC = str(Path(sys.executable).with_name("mpiexec"))


@functools.lru_cache(maxsize=None)
def launcher() -> Launcher:
    return find_launcher(MPIEXEC)


@functools.lru_cache(maxsize=None)
def mpi_library() -> Library:
    """The MPI that mpi4py loads in this venv (asked once, without MPI_Init)."""
    return library()


def mpiexec(np: int) -> list[str]:
    """``mpiexec -n np`` as hvdliterun would spell it for this MPI."""
    return [MPIEXEC, *flavor_flags(launcher().flavor, np, os.cpu_count()), "-n", str(np)]


ROOT = Path(__file__).resolve().parents[1]


def run_module(np: int, module: str, env: dict[str, str],
               timeout: float) -> subprocess.CompletedProcess[str]:
    """``python -m module`` on ``np`` ranks from the repository root, in an environment
    without the caller's HVDLITE_* and HOROVOD_* settings (only ``env``'s)."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("HVDLITE_", "HOROVOD_"))}
    full_env.update(PYTHONPATH=str(ROOT), **env)
    return subprocess.run([*mpiexec(np), sys.executable, "-m", module], cwd=ROOT, env=full_env,
                          capture_output=True, text=True, timeout=timeout)
