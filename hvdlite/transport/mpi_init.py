"""MPI's own start and end, as hvdlite needs them.

mpi4py initialises MPI when its ``MPI`` module is first imported, unless the program
set ``mpi4py.rc.initialize = False`` (Horovod's tests and some job scripts do, to
leave MPI to Horovod). Then ``hvd.init()`` initialises MPI itself, as Horovod does,
and finalizes it when the interpreter ends. Not in ``hvd.shutdown()``: MPI cannot be
initialised twice in a process, so a later ``hvd.init()`` (a retry after a failed
one, a new session) and the program's own mpi4py calls keep working until exit.
MPI that the program or mpi4py initialised is theirs to finalize.

The thread level: hvdlite's engine thread, not the main thread, makes the MPI calls,
which takes at least ``MPI_THREAD_SERIALIZED``; the program's own mpi4py calls while
hvdlite runs take ``MPI_THREAD_MULTIPLE`` (mpi4py's default request).
"""
from __future__ import annotations

import atexit
from typing import Any

from hvdlite.errors import HvdliteError, UsageError

LEVEL_NAMES = ("single", "funneled", "serialized", "multiple")   # MPI_THREAD_* order
NEEDED = "serialized"


def ensure_initialized() -> Any:
    """The mpi4py ``MPI`` module, with MPI initialised at a thread level the engine
    can use; raises if it was finalized or runs at too low a level."""
    import mpi4py
    from mpi4py import MPI      # initialises MPI here unless rc.initialize is False
    if MPI.Is_finalized():
        raise HvdliteError(
            "hvdlite.init(): MPI has already been finalized in this process and cannot "
            "be initialised again; call MPI.Finalize() only after the last hvdlite.shutdown()")
    if not MPI.Is_initialized():
        MPI.Init_thread(_levels(MPI)[requested_level(mpi4py.rc)])
        atexit.register(_finalize)
    check_thread_level(MPI.Query_thread(), _levels(MPI), MPI.COMM_WORLD.Get_rank())
    return MPI


def requested_level(rc: Any) -> str:
    """The level to ask for: the one mpi4py's ``rc`` asks for (``thread_level``, or
    single with ``rc.threads = False``), raised to what the engine needs."""
    wanted = str(rc.thread_level).lower() if rc.threads else "single"
    if wanted not in LEVEL_NAMES:
        wanted = "multiple"     # mpi4py would refuse it; ask for its own default
    return max(wanted, NEEDED, key=LEVEL_NAMES.index)


def check_thread_level(provided: int, levels: dict[str, int], rank: int) -> None:
    if provided >= levels[NEEDED]:
        return
    name = next((n for n, value in levels.items() if value == provided), str(provided))
    raise UsageError(
        f"rank {rank}: MPI runs at thread level '{name}', but hvdlite's engine thread "
        f"makes MPI calls, which needs at least '{NEEDED}' ('multiple' if your code calls "
        "mpi4py while hvdlite runs). Let mpi4py initialise MPI at its default level "
        "(mpi4py.rc.thread_level = 'multiple'), or initialise it yourself with "
        "MPI.Init_thread(MPI.THREAD_MULTIPLE).")


def _levels(MPI: Any) -> dict[str, int]:
    return {name: getattr(MPI, f"THREAD_{name.upper()}") for name in LEVEL_NAMES}


def _finalize() -> None:
    """At exit, after hvdlite's own shutdown (registered later, so run earlier), MPI
    that hvdlite initialised: without MPI_Finalize, MPICH's launcher kills the ranks
    still running as soon as one process ends."""
    from mpi4py import MPI
    if MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.Finalize()
