"""A job that starts hvdlite with the outputs the test set (HVDLITE_REPORT,
HVDLITE_TIMELINE, HVDLITE_ELASTIC_DIR), run by tests/integration/test_outputs.py.
Each rank prints one line: REFUSED with the error init() raised (then re-raises
it, so the job ends as an uncaught error would), or STARTED after a step, with
whether the paths in OUTPUTS_ABSENT still do not exist (the check creates nothing).
With OUTPUTS_COMMITS=n it then commits n times through hvd.elastic.run, and with
OUTPUTS_FULL_AT=k rank 0's k-th write of the committed state finds the disk full:
each rank prints COMMIT FAILED with the error and re-raises it."""
from __future__ import annotations

import errno
import os
import sys
from typing import Any

import numpy as np

import hvdlite as hvd
from hvdlite.elastic import persist


def _say(line: str) -> None:
    os.write(1, (line + "\n").encode())     # one write: ranks' lines never interleave


def _fill_the_disk_at(write: int) -> None:
    """Rank 0's ``write``-th committed state, and every later one, fails with ENOSPC."""
    real, calls = persist._write_content, [0]

    def full(handle: Any, entries: Any, commits: int) -> None:
        calls[0] += 1
        if calls[0] >= write:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(handle, entries, commits)

    persist._write_content = full


def _commit(count: int) -> None:
    state = hvd.elastic.ObjectState(hvd.broadcast_object, hvd.rank, step=0)

    @hvd.elastic.run
    def train(state: hvd.elastic.ObjectState) -> None:
        for step in range(1, count + 1):
            state.step = step
            state.commit()

    try:
        train(state)
    except hvd.HvdliteError as exc:
        _say(f"COMMIT FAILED rank {hvd.rank()}: {type(exc).__name__}: {exc}")
        raise


def main() -> None:
    try:
        hvd.init()
    except hvd.HvdliteError as exc:
        from mpi4py import MPI
        _say(f"REFUSED rank {MPI.COMM_WORLD.Get_rank()}: {type(exc).__name__}: {exc}")
        raise
    absent = [p for p in os.environ.get("OUTPUTS_ABSENT", "").split(os.pathsep) if p]
    created = [p for p in absent if os.path.exists(p)]
    hvd.allreduce(np.ones(2), name="step")
    _say(f"STARTED rank {hvd.rank()} created={created}")
    full_at = int(os.environ.get("OUTPUTS_FULL_AT", "0"))
    if full_at and hvd.rank() == 0:
        _fill_the_disk_at(full_at)
    if int(os.environ.get("OUTPUTS_COMMITS", "0")):
        _commit(int(os.environ["OUTPUTS_COMMITS"]))
        _say(f"COMMITTED rank {hvd.rank()}")


if __name__ == "__main__":
    sys.exit(main())
