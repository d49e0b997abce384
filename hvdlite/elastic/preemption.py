"""Preemption: SIGUSR1 asks the job to commit and stop, so SLURM can requeue it.

SLURM sends the signal ahead of a preemption or the time limit (``--signal``);
it may reach the ranks at different steps, or reach only some of them. A rank
only records it here. Every ``check_host_updates()`` (so every ``commit()``)
reduces the ranks' flags with Max, so all ranks learn of it at the same step
boundary, persist the last commit and leave with :data:`PREEMPTED_EXIT_CODE`,
which the job script turns into ``scontrol requeue``.
"""
from __future__ import annotations

import signal
import threading
from typing import Any, Optional

import numpy as np

from hvdlite.api import collectives, submission
from hvdlite.api.adapter import NUMPY
from hvdlite.reduce_op import ReduceOp

# EX_TEMPFAIL (sysexits.h): a temporary failure, the caller is invited to retry.
PREEMPTED_EXIT_CODE = 75

_requested = threading.Event()
_previous: Optional[Any] = None
_installed = False


def _on_signal(signum: int, frame: Any) -> None:
    _requested.set()


def install() -> None:
    """Record SIGUSR1 instead of dying of it (its default). Main thread only, as
    Python requires; elsewhere the signal keeps its default action."""
    global _previous, _installed
    if _installed or threading.current_thread() is not threading.main_thread():
        return
    _previous = signal.signal(signal.SIGUSR1, _on_signal)
    _installed = True


def uninstall() -> None:
    global _installed
    if _installed:
        signal.signal(signal.SIGUSR1, _previous if _previous is not None else signal.SIG_DFL)
        _installed = False


def request() -> None:
    """As if SIGUSR1 had arrived (tests, or a script's own stop condition)."""
    _requested.set()


def requested_here() -> bool:
    return _requested.is_set()


def agree(host_timestamp: int) -> tuple[bool, int]:
    """One small allreduce (Max) at a step boundary: (whether any rank was asked to
    stop, the newest host-update timestamp any rank has seen)."""
    flags = np.array([1 if _requested.is_set() else 0, host_timestamp], dtype=np.int64)
    agreed = submission.synchronize(collectives.allreduce_async(
        NUMPY, flags, op=ReduceOp.MAX, name="hvdlite.elastic.boundary"))
    return bool(agreed[0]), int(agreed[1])


class Preempted(BaseException):
    """Raised at the agreed step boundary, on every rank, after the last commit was
    written; ``hvd.elastic.run`` turns it into the requeue exit code. A
    BaseException so a training loop's ``except Exception`` does not swallow it."""
