"""Run pytest on every rank: ``mpiexec -n N python tests/mpi/run.py tests/mpi``.

Every rank parses the same arguments (a flag one rank rejected would leave the
others waiting for it in hvdlite.init()); only rank 0's report reaches the
terminal. conftest.py makes a failure on any rank fail that test on every rank,
with the failing ranks' tracebacks in rank 0's report, so the job's exit code
and output tell the truth.
"""
from __future__ import annotations

import os
import sys

import pytest
from mpi4py import MPI

if __name__ == "__main__":
    rank = MPI.COMM_WORLD.Get_rank()
    args = sys.argv[1:]
    if rank != 0:
        sys.stdout = open(os.devnull, "w")     # reports: rank 0's only
        args = ["-p", "no:cacheprovider"] + args
    code = pytest.main(args)
    sys.stdout.flush()
    # Every rank must agree on the outcome; the worst exit code wins.
    worst = MPI.COMM_WORLD.allreduce(int(code), op=MPI.MAX)
    if rank == 0 and worst != int(code):
        print(f"[tests/mpi] another rank exited with pytest code {worst}", flush=True)
    sys.exit(worst)
