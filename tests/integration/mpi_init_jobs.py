"""Jobs whose program decides how MPI starts (mpi4py.rc.initialize = False), run by
tests/integration/test_mpi_init.py. Each line a rank prints is one write, so ranks'
lines never interleave. Run as: python -m tests.integration.mpi_init_jobs JOB."""
from __future__ import annotations

import atexit
import os
import sys
import time

import mpi4py

mpi4py.rc.initialize = False           # before anything imports mpi4py.MPI
if os.environ.get("JOB_THREAD_LEVEL"):
    mpi4py.rc.thread_level = os.environ["JOB_THREAD_LEVEL"]
from mpi4py import MPI                 # noqa: E402  (after the rc settings, on purpose)

import numpy as np                     # noqa: E402

import hvdlite as hvd                  # noqa: E402

LEVELS = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
          MPI.THREAD_SERIALIZED: "serialized", MPI.THREAD_MULTIPLE: "multiple"}


def _say(line: str) -> None:
    os.write(1, (line + "\n").encode())


def _report_at_exit(what: str, rank: list[int]) -> None:
    """At exit, whether MPI is finalized. Exit hooks run last registered first: one
    registered before hvd.init() runs after every hook hvdlite registers. ``rank`` is
    filled in once MPI runs (no MPI call may follow MPI_Finalize)."""
    atexit.register(lambda: _say(f"{what} rank {rank[0]} finalized={MPI.Is_finalized()}"))


def _train_a_step(name: str) -> None:
    result = hvd.allreduce(np.ones(3), op=hvd.Sum, name=name)
    assert result.tolist() == [float(hvd.size())] * 3, result


def left_to_hvdlite() -> None:
    """Horovod's test_process_sets_static.py's course, then the end of the job: a
    refused first init leaves nothing started, the corrected one works, the
    program's own mpi4py calls work while hvdlite runs and after its shutdown,
    and the rank that ends last is not killed by the others' ending."""
    rank = [-1]
    _report_at_exit("AT_EXIT", rank)
    assert not MPI.Is_initialized(), "mpi4py initialised MPI although rc.initialize is False"
    world = int(os.environ["JOB_SIZE"])     # MPI cannot be asked before it runs
    try:
        hvd.init(process_sets=[hvd.ProcessSet([0]), hvd.ProcessSet(range(world - 1, -1, -1)),
                               hvd.ProcessSet([0])])
    except ValueError as exc:
        _say(f"REFUSED rank {MPI.COMM_WORLD.Get_rank()} initialized={hvd.is_initialized()}: "
             f"{exc}")
    first, rest = hvd.ProcessSet([0]), hvd.ProcessSet(range(1, world))
    hvd.init(process_sets=[first, rest])
    rank[0] = hvd.rank()
    _say(f"STARTED rank {hvd.rank()} level={LEVELS[MPI.Query_thread()]} "
         f"ids={[first.process_set_id, rest.process_set_id]}")
    _train_a_step("step")
    if MPI.Query_thread() == MPI.THREAD_MULTIPLE:   # the only level that allows it:
        MPI.COMM_WORLD.barrier()        # the program's own MPI call while the engine runs
    hvd.shutdown()
    MPI.COMM_WORLD.barrier()            # and after hvdlite's shutdown
    if MPI.COMM_WORLD.Get_rank() == MPI.COMM_WORLD.Get_size() - 1:
        time.sleep(1.5)                 # the other ranks have ended by now
    _say(f"DONE rank {MPI.COMM_WORLD.Get_rank()}")


def initialized_by_the_program() -> None:
    """MPI the program initialised is the program's to finalize. Exit hooks run last
    registered first: hvdlite's, then the check, then the program's MPI.Finalize."""
    rank = [-1]
    _report_at_exit("AT_EXIT", rank)
    atexit.register(MPI.Finalize)
    _report_at_exit("BEFORE_FINALIZE", rank)
    MPI.Init_thread(MPI.THREAD_MULTIPLE)
    hvd.init()
    rank[0] = hvd.rank()
    _train_a_step("step")
    hvd.shutdown()


def too_low_a_thread_level() -> None:
    """The program initialised MPI at a level the engine thread cannot use."""
    MPI.Init_thread(MPI.THREAD_FUNNELED)
    try:
        hvd.init()
    except hvd.UsageError as exc:
        _say(f"REFUSED rank {MPI.COMM_WORLD.Get_rank()}: {exc}")
    MPI.Finalize()


if __name__ == "__main__":
    globals()[sys.argv[1]]()
