"""The multi-rank suite's own harness (tests/mpi/run.py and tests/mpi/conftest.py): a test
that fails on one rank only fails on every rank, with that rank's traceback in rank 0's
report, and the job's exit code says so. Ranks that finish a test first wait for the
others asleep before the outcomes are exchanged; this is what must survive that."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.mpirun import mpiexec

ROOT = Path(__file__).resolve().parents[2]
ONE_RANK_FAILS = '''
import time
import hvdlite as hvd


def test_fails_on_the_last_rank_only():
    if hvd.rank() == 0:
        time.sleep(0.5)        # rank 0 finishes last: the others wait for it
    assert hvd.rank() != hvd.size() - 1, "planted failure on the last rank"


def test_passes_everywhere():
    assert hvd.size() > 1
'''


@pytest.mark.timeout(150)
@pytest.mark.parametrize("np", [2, 4])
def test_a_test_that_fails_on_one_rank_fails_the_run_on_every_rank(tmp_path: Path,
                                                                    np: int) -> None:
    script = tmp_path / "test_one_rank_fails.py"
    script.write_text(ONE_RANK_FAILS)
    command = mpiexec(np) + [sys.executable, "tests/mpi/run.py", "-p", "tests.mpi.conftest",
                            "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                            str(script)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    assert "1 failed, 1 passed" in output, output       # rank 0's own report
    assert f"[failed on rank(s) [{np - 1}]]" in output, output
    assert "planted failure on the last rank" in output, output
