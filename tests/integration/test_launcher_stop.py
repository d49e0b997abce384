"""hvdliterun told to stop (SIGTERM) while its launcher ignores the signal, as MPICH's
mpiexec does when it spins before starting any rank (issue 34): the launcher, and what
it started, are killed after the grace period, with or without --elastic.

The launcher is a stand-in (tests/integration/stubborn_launcher.py), so no MPI runs
and the test takes the grace period, not a job's time."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hvdlite.runner.supervise import GRACE_SECONDS
from tests.processes import alive

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(90)


def _stand_in(tmp_path: Path) -> Path:
    """An executable "mpiexec" that runs stubborn_launcher.py with this Python."""
    path = tmp_path / "mpiexec"
    path.write_text(f"#!/bin/sh\nexec {sys.executable} -m tests.integration.stubborn_launcher "
                    '"$@"\n')
    path.chmod(0o755)
    return path


def _pids(path: Path, timeout: float = 30) -> list[int]:
    """The stand-in's pid and its child's, once it has written both."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().endswith("\n"):
            return [int(pid) for pid in path.read_text().split()]
        time.sleep(0.1)
    raise AssertionError(f"the stand-in launcher did not start within {timeout} s")


@pytest.mark.parametrize("mode", [[], ["--elastic", "--max-restarts", "2"]],
                         ids=["plain", "elastic"])
def test_a_launcher_that_ignores_sigterm_is_killed_after_the_grace_period(
        mode: list[str], tmp_path: Path) -> None:
    pid_file = tmp_path / "pids"
    env = dict(os.environ, PYTHONPATH=str(ROOT), STUBBORN_PIDS=str(pid_file),
               TMPDIR=str(tmp_path), HVDLITE_ELASTIC_DIR=str(tmp_path / "state"))
    proc = subprocess.Popen([sys.executable, "-m", "hvdlite.run", "-np", "2", *mode,
                             "--mpiexec", str(_stand_in(tmp_path)), "true"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        pids = _pids(pid_file)
        began = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=GRACE_SECONDS + 20)
        took = time.monotonic() - began
        assert proc.returncode == 128 + signal.SIGKILL, (proc.returncode, out, err)
        assert GRACE_SECONDS - 0.5 <= took < GRACE_SECONDS + 10, (took, err)
        assert (f"did not stop within {GRACE_SECONDS:g} s of SIGTERM; killed it and 1 "
                "process(es) under it (SIGKILL)") in err, err
        assert not any(alive(pid) for pid in pids), err      # the launcher and its child
    finally:
        proc.kill()
        proc.wait()
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
