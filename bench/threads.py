"""Where a benchmark process spends its CPU: seconds per thread, read from
``/proc/self/task`` (Linux), grouped as the training thread (the main one),
hvdlite's engine thread, and everything else (MPI's, gloo's and OpenMP's helper
threads). Also the process's peak resident memory."""
from __future__ import annotations

import os
import resource
import threading
from typing import Optional

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cpu_by_thread() -> dict[int, float]:
    """CPU seconds (user + system) of each live thread of this process, by thread id."""
    seconds: dict[int, float] = {}
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return seconds
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/stat") as stat:
                # Fields after the command name, which may hold spaces: utime, stime are
                # the 12th and 13th of what follows ") ".
                fields = stat.read().rsplit(")", 1)[1].split()
            seconds[int(tid)] = (int(fields[11]) + int(fields[12])) / _TICK
        except (OSError, IndexError, ValueError):
            continue        # a thread that ended meanwhile
    return seconds


def _engine_thread_id() -> Optional[int]:
    for thread in threading.enumerate():
        if thread.name == "hvdlite-engine":
            return thread.native_id
    return None


class ThreadClock:
    """CPU seconds per group of threads between ``start()`` and ``stop()``."""

    def __init__(self) -> None:
        self._before: dict[int, float] = {}
        self.seconds: dict[str, float] = {}

    def start(self) -> None:
        self._before = _cpu_by_thread()

    def stop(self) -> dict[str, float]:
        after = _cpu_by_thread()
        main, engine = threading.main_thread().native_id, _engine_thread_id()
        groups = {"training": 0.0, "engine": 0.0, "helpers": 0.0}
        for tid, seconds in after.items():
            spent = seconds - self._before.get(tid, 0.0)
            group = "training" if tid == main else "engine" if tid == engine else "helpers"
            groups[group] += spent
        self.seconds = groups
        return groups


def peak_rss_mib() -> float:
    """This process's peak resident memory so far, in MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
