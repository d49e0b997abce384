"""Run pytest on every rank: ``mpiexec -n N python tests/mpi/run.py tests/mpi``, or
under torchrun (torch.distributed over Gloo; mpi4py need not be installed):
``python -m torch.distributed.run --nproc_per_node=N tests/mpi/run.py tests/mpi``.

Every rank parses the same arguments (a flag one rank rejected would leave the
others waiting for it in hvdlite.init()); only rank 0's report reaches the
terminal. conftest.py makes a failure on any rank fail that test on every rank,
with the failing ranks' tracebacks in rank 0's report, so the job's exit code
and output tell the truth.
"""
from __future__ import annotations

import os
import sys

from pathlib import Path

import pytest

# Run as a script, this directory comes first on sys.path, not the repository's root.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.mpi.outcomes import channel  # noqa: E402

if __name__ == "__main__":
    results = channel()
    rank = results.rank
    args = sys.argv[1:]
    if rank != 0:
        sys.stdout = open(os.devnull, "w")     # reports: rank 0's only
        args = ["-p", "no:cacheprovider"] + args
    code = pytest.main(args)
    sys.stdout.flush()
    # Every rank must agree on the outcome; the worst exit code wins.
    worst = results.worst(int(code))
    results.close()
    if rank == 0 and worst != int(code):
        print(f"[tests/mpi] another rank exited with pytest code {worst}", flush=True)
    sys.exit(worst)
