"""The CPU stand-in for CuPy and NCCL (tests/standin) catches the bugs it is for:
each of gpu_standin.PLANTS puts one bug into hvdlite/backends/nccl.py's own source
(an offset off by the item size, a count one short, a count in bytes instead of
elements), and the stand-in's differential test must then fail, on every rank,
with the case named, within its time limit: never pass, never hang."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.mpirun import mpiexec
from tests.standin.gpu_standin import PLANTS

ROOT = Path(__file__).resolve().parents[2]
RUN = [sys.executable, "tests/mpi/run.py", "tests/standin", "-q", "-s", "-x", "-p", "no:cacheprovider",
       "-k", "every_collective and nccl"]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_a_planted_nccl_bug_fails_the_stand_in(plant: str) -> None:
    env = {**os.environ, "STANDIN_PLANT": plant, "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(mpiexec(2) + RUN, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=150)
    output = done.stdout + done.stderr
    assert done.returncode != 0, f"the stand-in passed with bug {plant!r} planted:\n{output}"
    assert "reproduce: DIFFERENTIAL_SEED=" in output or "IllegalAddress" in output, output[-3000:]


def test_without_a_plant_the_stand_in_passes() -> None:
    """The control: the same command, nothing planted."""
    env = {k: v for k, v in os.environ.items() if k != "STANDIN_PLANT"}
    done = subprocess.run(mpiexec(2) + RUN, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=150)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
