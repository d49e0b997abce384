"""One failing rank ends the whole job, with its traceback printed once.

Under MPICH a rank that dies of an uncaught exception otherwise waits in
MPI_Finalize while its peers wait in a collective: the job hangs. The hook
prints the traceback with the rank's identity and aborts COMM_WORLD, so the
launcher stops every rank and exits non-zero within seconds.
"""
from __future__ import annotations

import socket
import sys
import threading
import traceback
from types import TracebackType
from typing import Any, Optional

from mpi4py import MPI

_installed = False


def _abort(rank: int, size: int, where: str, exc_type: type, exc: BaseException,
           tb: Optional[TracebackType]) -> None:
    header = (f"[hvdlite] rank {rank} of {size} on {socket.gethostname()}: uncaught "
              f"{exc_type.__name__} in {where}; aborting the job (HVDLITE_ABORT_ON_ERROR=0 "
              "disables this)\n")
    text = header + "".join(traceback.format_exception(exc_type, exc, tb))
    try:
        sys.stderr.write(text)
        sys.stderr.flush()
    finally:
        MPI.COMM_WORLD.Abort(1)


def install(rank: int, size: int) -> None:
    """Idempotent: chain onto sys.excepthook and threading.excepthook."""
    global _installed
    if _installed or size == 1:
        return
    _installed = True

    def main_hook(exc_type: type, exc: BaseException, tb: Optional[TracebackType]) -> None:
        _abort(rank, size, "the main thread", exc_type, exc, tb)

    def thread_hook(args: Any) -> None:
        if args.exc_type is SystemExit:
            return
        name = args.thread.name if args.thread is not None else "a thread"
        _abort(rank, size, f"thread {name!r}", args.exc_type, args.exc_value, args.exc_traceback)

    sys.excepthook = main_hook
    threading.excepthook = thread_hook
