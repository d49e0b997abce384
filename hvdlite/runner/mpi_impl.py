"""Which MPI launcher is at hand, and the flags each one needs."""
from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
from typing import Optional


@dataclasses.dataclass(frozen=True)
class Launcher:
    path: str
    flavor: str      # "mpich" (hydra) or "openmpi"
    version: str


def find_launcher(explicit: Optional[str] = None) -> Launcher:
    """The venv's own mpiexec first (a system one may belong to another MPI than
    the one mpi4py was built against), then PATH."""
    candidates = [explicit] if explicit else [
        os.path.join(os.path.dirname(sys.executable), "mpiexec"), shutil.which("mpiexec"),
        shutil.which("mpirun")]
    for path in candidates:
        if path and os.access(path, os.X_OK):
            version = _version_text(path)
            flavor = "openmpi" if "Open MPI" in version or "OpenRTE" in version else "mpich"
            lines = [line.strip() for line in version.splitlines() if line.strip()]
            named = [line for line in lines if "version" in line.lower()]
            return Launcher(path, flavor, (named or lines or [""])[0])
    raise FileNotFoundError(
        "no mpiexec found next to this Python or on PATH; install one with "
        "`pip install mpich` (or your cluster's MPI module)")


def _version_text(path: str) -> str:
    try:
        done = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout + done.stderr


def hosts_argument(flavor: str, hosts: Optional[str], hostfile: Optional[str]) -> list[str]:
    """``-H a:2,b:2`` / ``--hostfile F`` in each launcher's spelling."""
    if hosts and hostfile:
        raise ValueError("give either -H/--hosts or --hostfile, not both")
    if hostfile:
        return ["-f", hostfile] if flavor == "mpich" else ["--hostfile", hostfile]
    if hosts:
        return ["-hosts", hosts] if flavor == "mpich" else ["--host", hosts]
    return []


def env_arguments(flavor: str, env: dict[str, str]) -> list[str]:
    """Pass variables to every rank explicitly, so --dry-run shows them."""
    args: list[str] = []
    for name, value in sorted(env.items()):
        args += ["-genv", name, value] if flavor == "mpich" else ["-x", f"{name}={value}"]
    return args


def flavor_flags(flavor: str, np: int, slots: Optional[int]) -> list[str]:
    """Open MPI refuses root without --allow-run-as-root and more ranks than cores
    without --oversubscribe; hydra needs neither."""
    if flavor != "openmpi":
        return []
    flags = ["--oversubscribe"] if slots is None or np > slots else []
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        flags.append("--allow-run-as-root")
    return flags
