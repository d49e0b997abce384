"""One failing rank ends the whole job, with its traceback printed once.

Under MPICH a rank that dies of an uncaught exception otherwise waits in
MPI_Finalize while its peers wait in a collective: the job hangs. The hook
prints the traceback with the rank's identity and aborts COMM_WORLD, so the
launcher stops every rank and exits non-zero within seconds.

Three things must reach the launcher intact:

- The text. MPI_Abort makes mpiexec exit at once, dropping whatever hydra has
  not yet read from the rank's stderr pipe (the traceback was lost in 4 runs
  out of 14). It is written straight to fd 2, synced, and given a moment.
- The status. mpiexec exits with the first abort's code. A rank leaving through
  ``sys.exit(3)`` would shut hvdlite down at exit, its peers would fail with
  ShutdownError and abort first, with 1; so it aborts with 3 itself instead.
- The end. After PeerLostError, MPI_Finalize would wait forever for the lost
  rank, so a process that caught the error aborts at exit, non-zero.

A rank that finds a peer lost says so at once, in one line on stderr
(``report_loss``): under MPICH's hydra, the first output after a rank was
killed ends the job (see exit_guard), so that line may be all it gets to say.
"""
from __future__ import annotations

import atexit
import os
import socket
import sys
import threading
import time
import traceback
from types import TracebackType
from typing import Any, Callable, NoReturn, Optional

# hydra's proxy forwards stderr as soon as it can read it; 0.3 s covers a loaded
# host, and an aborting job loses nothing that matters in that time.
ABORT_GRACE_S = 0.3
# After a peer is lost, the other survivors learn of it within a liveness tick
# (0.1 s) and print their own errors; leave them time before tearing the job down.
BROKEN_EXIT_GRACE_S = 1.0
PEER_LOST_STATUS = 1

_installed = False
_who: Optional[tuple[int, int]] = None      # (rank, size), for messages
_exit_status: Optional[int] = None          # set as the interpreter ends via sys.exit(n)
_broken: Optional[str] = None               # why the world is broken, once it is
_BASE_CODE = SystemExit.code                # the C-level attribute behind SystemExit.code
# Why a job that lost a rank must not end normally: what would wait for the lost rank on
# the world's transport, as init() says (use_transport).
_lost_rank_wait = "the transport would wait for the lost rank at the end"

def use_transport(lost_rank_wait: str, abort: Callable[[int], None]) -> None:
    """What would wait for a lost rank on the world's transport ("MPI_Finalize would wait
    ...") and how it ends the whole job (MPI_Abort on COMM_WORLD; under torchrun, this
    process's exit, after which the agent stops the others): the transport's own
    ``lost_rank_wait`` and ``abort``, set by init() before anything can fail."""
    global _lost_rank_wait, _abort_world
    _lost_rank_wait, _abort_world = lost_rank_wait, abort


def _end_this_process(status: int) -> None:
    os._exit(status)


# How to end the whole job: the world transport's way, once init() said (use_transport).
_abort_world: Callable[[int], None] = _end_this_process


def emit(text: str, grace: float = ABORT_GRACE_S) -> None:
    """Write ``text`` to stderr so that it survives an MPI_Abort right after."""
    for stream in (sys.stdout, sys.stderr):   # whatever Python buffered comes first
        try:
            stream.flush()
        except Exception:           # a closed or replaced stream must not block the abort
            pass
    data = text.encode("utf-8", "replace")
    try:
        while data:
            data = data[os.write(2, data):]
    except OSError:
        pass
    try:
        os.fsync(2)                 # a file: on disk; pipes and terminals refuse, harmlessly
    except OSError:
        pass
    time.sleep(grace)


def abort_now(status: int) -> NoReturn:
    """The transport's abort (MPI_Abort), and make sure this process ends here: under
    MPICH's ABI build MPI_Abort can return once the launcher has the request, and the
    interpreter would then run its exit handlers (and print their output) until killed."""
    try:
        _abort_world(status)
    finally:
        os._exit(status)


def _identify() -> str:
    rank, size = _who or ("?", "?")     # every caller runs after install() or mark_broken()
    return f"[hvdlite] rank {rank} of {size} on {socket.gethostname()}"


def _abort(where: str, exc_type: type, exc: BaseException,
           tb: Optional[TracebackType]) -> None:
    header = (f"{_identify()}: uncaught {exc_type.__name__} in {where}; aborting the job "
              "(HVDLITE_ABORT_ON_ERROR=0 disables this)\n")
    text = header + "".join(traceback.format_exception(exc_type, exc, tb))
    try:
        emit(text)
    finally:
        abort_now(1)


def _status(code: object) -> int:
    """The process exit status Python derives from a SystemExit code."""
    if code is None:
        return 0
    if isinstance(code, int):
        return int(code) & 0xFF   # what the shell sees: sys.exit(256) is a success
    return 1   # a message: Python prints it and exits 1


class _TrackedExit(SystemExit):
    """What sys.exit raises while hvdlite runs. When this exception ends the program,
    the interpreter reads ``code`` from C, with no Python frame left on the stack;
    code that catches it and reads ``code`` has one. Only the former is recorded,
    so a caught sys.exit() leaves no trace."""

    @property
    def code(self) -> Any:   # type: ignore[override]
        global _exit_status
        code = _BASE_CODE.__get__(self)
        try:
            sys._getframe(1)
        except ValueError:
            if threading.current_thread() is threading.main_thread():
                _exit_status = _status(code)
        return code


def _exit(status: object = None, /) -> NoReturn:
    raise _TrackedExit(status)


def install(rank: int, size: int) -> None:
    """Idempotent: replace sys.excepthook, threading.excepthook and sys.exit; an abort
    then ends the job the transport's way (use_transport)."""
    global _installed, _who
    _who = (rank, size)
    if _installed or size == 1:
        return
    _installed = True

    def main_hook(exc_type: type, exc: BaseException, tb: Optional[TracebackType]) -> None:
        _abort("the main thread", exc_type, exc, tb)

    def thread_hook(args: Any) -> None:
        if args.exc_type is SystemExit:
            return
        name = args.thread.name if args.thread is not None else "a thread"
        _abort(f"thread {name!r}", args.exc_type, args.exc_value, args.exc_traceback)

    sys.excepthook = main_hook
    threading.excepthook = thread_hook
    sys.exit = _exit


def abort_if_exiting_with_error() -> None:
    """At interpreter exit, before hvdlite tells its peers it shuts down: a process
    ending through sys.exit(n), n != 0, aborts with n so the job's status is n."""
    if _exit_status:
        emit(f"{_identify()}: exiting with status {_exit_status} (sys.exit) while the "
             "other ranks still run hvdlite; aborting the job with that status "
             "(HVDLITE_ABORT_ON_ERROR=0 disables this)\n")
        abort_now(_exit_status)


def mark_broken(rank: int, size: int, reason: str) -> None:
    """A peer is lost: MPI_Finalize would wait for it forever, and a job whose
    survivors caught the error must not end with status 0. Abort at exit."""
    global _broken, _who
    _who = _who or (rank, size)
    if _broken is None:
        _broken = reason
        atexit.register(abort_if_broken)


def report_loss(rank: int, size: int, message: str) -> None:
    """This rank found a peer lost: mark the world broken and say so, in one line, now
    (before the user threads wake to raise PeerLostError)."""
    mark_broken(rank, size, message)
    emit(f"{_identify()}: PeerLostError: {message}\n", grace=0.0)


def abort_if_broken() -> None:
    if _broken is not None:
        status = _exit_status or PEER_LOST_STATUS
        emit(f"{_identify()}: exiting after losing a peer; aborting the job with status "
             f"{status}, since {_lost_rank_wait}. The "
             f"loss: {_broken}\n", BROKEN_EXIT_GRACE_S)
        abort_now(status)
