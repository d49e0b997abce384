"""A job started with a different environment per rank (mpiexec's MPMD form), run by
tests/integration/test_settings_agreement.py. Each rank prints one line: REFUSED with
the error init() raised (then, once every rank has said it, re-raises it, as an
uncaught error would end the job), or STARTED after one allreduce."""
from __future__ import annotations

import os
import sys

import numpy as np

import hvdlite as hvd


def _say(line: str) -> None:
    os.write(1, (line + "\n").encode())     # one write: ranks' lines never interleave


def main() -> None:
    try:
        hvd.init()
    except hvd.HvdliteError as exc:
        from mpi4py import MPI
        _say(f"REFUSED rank {MPI.COMM_WORLD.Get_rank()}: {type(exc).__name__}: {exc}")
        # The launcher ends every rank once one ends with an error: each says what it got
        # first (init() failed before its engine ran anything, so MPI is this thread's).
        MPI.COMM_WORLD.Barrier()
        raise
    hvd.allreduce(np.ones(2), name="step")
    _say(f"STARTED rank {hvd.rank()}")


if __name__ == "__main__":
    sys.exit(main())
