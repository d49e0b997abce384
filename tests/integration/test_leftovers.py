"""What a job ended by a killed rank leaves in /dev/shm and /tmp, and its sweep
(hvdlite/runner/leftovers.py): by each test session, and by hvdliterun after a job that
failed, on real MPICH jobs. (Open MPI removes its segment after a killed rank; it leaves
it when mpirun itself is killed, with ranks still running, so that runs only under MPICH:
make test's lane A.)"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hvdlite.runner import leftovers
from tests.mpirun import mpiexec

pytestmark = pytest.mark.timeout(120)

# The ranks share memory through the MPI's segment (an allreduce on one node), rank 0 writes
# the segment it maps to the file named by argv[1], then rank 1 dies by SIGKILL, as a rank
# killed by the OOM killer or the batch system does. Other jobs may run on the machine
# meanwhile (make test runs two lanes side by side): their files come and go, so the tests
# judge only the segment this job names, and that the sweep took nothing older.
_KILLED_JOB = """
import os, signal, sys
import numpy as np
from mpi4py import MPI
comm = MPI.COMM_WORLD
x = np.ones(1 << 16)
comm.Allreduce(MPI.IN_PLACE, x)
if comm.Get_rank() == 0:
    with open('/proc/self/maps') as maps:
        mine = sorted({line.split()[-1] for line in maps if '/dev/shm/mpich_shm_' in line})
    with open(sys.argv[1], 'w') as out:
        out.write('\\n'.join(mine))
comm.bcast(None, root=0)
if comm.Get_rank() == 1:
    os.kill(os.getpid(), signal.SIGKILL)
comm.Barrier()
"""


def _job_segments(report: Path) -> set[Path]:
    segments = {Path(line) for line in report.read_text().split()}
    assert segments, "the job mapped no MPICH segment: nothing for the sweep to find"
    return segments


def test_a_job_with_a_killed_rank_leaves_files_and_the_sweep_removes_them(
        tmp_path: Path) -> None:
    before = leftovers.present()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HVDLITE_", "HOROVOD_"))}
    report = tmp_path / "segments"
    done = subprocess.run([*mpiexec(2), sys.executable, "-c", _KILLED_JOB, str(report)],
                          env=env, capture_output=True, text=True, timeout=90)
    assert done.returncode != 0, done.stdout + done.stderr
    segments = _job_segments(report)
    left = leftovers.present() - before
    assert segments <= left, "the MPI removed its own segment this time: nothing to sweep"
    removed = set(leftovers.sweep(before))
    assert segments <= removed and removed <= left
    assert not segments & leftovers.present()


def test_hvdliterun_removes_what_its_failed_job_left_on_this_node(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HVDLITE_", "HOROVOD_"))}
    script = tmp_path / "killed.py"
    script.write_text(_KILLED_JOB)
    report = tmp_path / "segments"
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-m", "hvdlite.run", "-np", "2", sys.executable,
                           str(script), str(report)], cwd=root, env=env, capture_output=True,
                          text=True, timeout=90)
    assert done.returncode != 0, done.stdout + done.stderr
    assert not _job_segments(report) & leftovers.present()
