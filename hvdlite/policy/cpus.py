"""How many CPUs this process may use, and whether it computes on a GPU.

The topology-aware defaults (``hvdlite.policy.defaults``) ask whether the ranks of
a node oversubscribe the CPUs the job was given. "Given" is the narrower of two
limits: the CPUs the process may run on (``sched_getaffinity``: a launcher's
binding, ``taskset``, a cpuset cgroup) and a CPU quota (a cgroup's ``cpu.max``
under cgroup v2, ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` under v1: what
``docker --cpus=2`` and Kubernetes CPU limits set). A quota of 1.5 CPUs lets two
busy threads run only three quarters of the time each, however many cores the
affinity mask shows.

No MPI here: pure reads of ``/proc`` and ``/sys``, unit-tested on made-up trees.
"""
from __future__ import annotations

import os
import sys
from typing import Optional

CGROUP_ROOT = "/sys/fs/cgroup"
PROC_CGROUP = "/proc/self/cgroup"


def affinity() -> frozenset[int]:
    """The CPUs this process may run on (all online CPUs where the OS cannot say)."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):     # macOS has no sched_getaffinity
        return frozenset(range(os.cpu_count() or 1))


def cgroup_quota(root: str = CGROUP_ROOT, proc_cgroup: str = PROC_CGROUP) -> Optional[float]:
    """The CPU quota of this process's cgroup in CPUs (1.5 for 150 ms per 100 ms), or
    None when there is none (``max``, ``-1``) or it cannot be read. Every level of
    the hierarchy up to the controller's root may set one; the tightest counts."""
    limits = []
    for base, relative, v2 in _cgroup_dirs(root, proc_cgroup):
        parts = [p for p in relative.split("/") if p]
        for depth in range(len(parts), -1, -1):      # the leaf first, the root last
            directory = os.path.join(base, *parts[:depth])
            quota = _v2_quota(directory) if v2 else _v1_quota(directory)
            if quota is not None:
                limits.append(quota)
    return min(limits) if limits else None


def cpus_available(root: str = CGROUP_ROOT, proc_cgroup: str = PROC_CGROUP) -> float:
    """CPUs this process can keep busy: its affinity mask, capped by a cgroup quota."""
    count = float(len(affinity()))
    quota = cgroup_quota(root, proc_cgroup)
    return count if quota is None else min(count, quota)


def _cgroup_dirs(root: str, proc_cgroup: str) -> list[tuple[str, str, bool]]:
    """(controller root, cgroup path under it, is v2) of this process's CPU cgroup,
    from /proc/self/cgroup lines ``0::/path`` (v2) and ``N:cpu,cpuacct:/path`` (v1)."""
    try:
        with open(proc_cgroup) as lines:
            entries = [line.rstrip("\n").split(":", 2) for line in lines]
    except OSError:
        return []
    found = []
    for entry in entries:
        if len(entry) != 3:
            continue
        _, controllers, path = entry
        if controllers == "":
            found.append((root, path, True))
        elif "cpu" in controllers.split(","):
            # v1 mounts the controller as cpu, cpu,cpuacct or both (one a symlink).
            for name in (controllers, "cpu", "cpu,cpuacct"):
                if os.path.isdir(os.path.join(root, name)):
                    found.append((os.path.join(root, name), path, False))
                    break
    return found


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as handle:
            return handle.read().strip()
    except OSError:
        return None


def _v2_quota(directory: str) -> Optional[float]:
    text = _read(os.path.join(directory, "cpu.max"))      # "max 100000" or "150000 100000"
    if not text:
        return None
    parts = text.split()
    try:
        if parts[0] == "max":
            return None
        return int(parts[0]) / int(parts[1]) if len(parts) > 1 and int(parts[1]) > 0 else None
    except ValueError:
        return None


def _v1_quota(directory: str) -> Optional[float]:
    quota = _read(os.path.join(directory, "cpu.cfs_quota_us"))
    period = _read(os.path.join(directory, "cpu.cfs_period_us"))
    try:
        if quota is None or period is None or int(quota) <= 0 or int(period) <= 0:
            return None
        return int(quota) / int(period)
    except ValueError:
        return None


def gpus_in_use() -> bool:
    """Whether this process computes on a GPU: a framework it already imported sees
    one (nothing is imported here: asking CUDA through a library the program does
    not use would cost seconds and memory for nothing)."""
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_available() and torch.cuda.device_count() > 0:
            return True
        tensorflow = sys.modules.get("tensorflow")
        if tensorflow is not None and tensorflow.config.list_physical_devices("GPU"):
            return True
        cupy = sys.modules.get("cupy")
        return cupy is not None and cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:     # no driver, a broken install: the CPU is the compute device
        return False
