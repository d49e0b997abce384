"""A job that starts hvdlite with the outputs the test set (HVDLITE_REPORT,
HVDLITE_TIMELINE, HVDLITE_ELASTIC_DIR), run by tests/integration/test_outputs.py.
Each rank prints one line: REFUSED with the error init() raised (then re-raises
it, so the job ends as an uncaught error would), or STARTED after a step, with
whether the paths in OUTPUTS_ABSENT still do not exist (the check creates nothing)."""
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
        raise
    absent = [p for p in os.environ.get("OUTPUTS_ABSENT", "").split(os.pathsep) if p]
    created = [p for p in absent if os.path.exists(p)]
    hvd.allreduce(np.ones(2), name="step")
    _say(f"STARTED rank {hvd.rank()} created={created}")


if __name__ == "__main__":
    sys.exit(main())
