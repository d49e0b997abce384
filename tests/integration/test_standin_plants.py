"""The CPU stand-in for CuPy and NCCL (tests/standin) catches the bugs it is for:
each of gpu_standin.PLANTS puts one bug into a GPU backend's own source (in
hvdlite/backends/nccl.py: an offset off by the item size, a count one short, a count
in bytes instead of elements; in torch_nccl.py, torchrun's: a padded part read from the
wrong place, a reducescatter part from the wrong start, a broadcast from rank 0
whatever the root), and the stand-in's differential test must then fail, on every
rank, with the case named, within its time limit: never pass, never hang."""
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
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


def _launch(plant: str) -> list[str]:
    """nccl.py's plants under mpiexec; torch_nccl.py's under torchrun (its sets only)."""
    return (TORCHRUN + RUN[1:]) if PLANTS[plant][0] == "torch_nccl" else (mpiexec(2) + RUN)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_a_planted_nccl_bug_fails_the_stand_in(plant: str, tmp_path: Path) -> None:
    env = {**os.environ, "STANDIN_PLANT": plant, "PYTHONUNBUFFERED": "1",
           "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)}   # torchrun's leftovers
    done = subprocess.run(_launch(plant), cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=150)
    output = done.stdout + done.stderr
    assert done.returncode != 0, f"the stand-in passed with bug {plant!r} planted:\n{output}"
    assert "reproduce: DIFFERENTIAL_SEED=" in output or "IllegalAddress" in output, output[-3000:]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("launcher", ["mpiexec", "torchrun"])
def test_without_a_plant_the_stand_in_passes(launcher: str, tmp_path: Path) -> None:
    """The control: the same commands, nothing planted."""
    env = {k: v for k, v in os.environ.items() if k != "STANDIN_PLANT"}
    env.update(OMP_NUM_THREADS="1", TMPDIR=str(tmp_path))
    command = mpiexec(2) + RUN if launcher == "mpiexec" else TORCHRUN + RUN[1:]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=150)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
