"""A setting given to some ranks only, the way job files and MPMD launches do it
(``mpiexec -n 1 env X=1 python job : -n 3 python job``): one that shapes the
collectives fails init() on every rank with a ConfigError naming the variable and
each rank's value, and the job ends at once instead of training into a deadlock; one
that is each rank's own starts the job, with one warning from rank 0. The job is
tests/integration/settings_job.py."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hvdlite.runner.mpi_impl import flavor_flags
from tests.mpirun import MPIEXEC, ROOT, launcher

pytestmark = pytest.mark.timeout(150)


def run_mpmd(np: int, first: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """The job on ``np`` ranks, ``first``'s variables set for rank 0 only."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HVDLITE_", "HOROVOD_"))}
    env.update(PYTHONPATH=str(ROOT), HVDLITE_PEER_TIMEOUT="5")
    job = [sys.executable, "-m", "tests.integration.settings_job"]
    command = [MPIEXEC, *flavor_flags(launcher().flavor, np, os.cpu_count()),
               "-n", "1", "env", *(f"{k}={v}" for k, v in first.items()), *job,
               ":", "-n", str(np - 1), *job]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("np", [2, 4])
@pytest.mark.parametrize("variable,value,setting,shown", [
    ("HVDLITE_AUTOTUNE", "1", "HVDLITE_AUTOTUNE", "True"),
    ("HVDLITE_BUCKET_BYTES", "0", "HVDLITE_BUCKET_BYTES", "0 B"),
    ("HOROVOD_FUSION_THRESHOLD", "1048576", "HVDLITE_FUSION_THRESHOLD", "1 MiB"),
    ("HOROVOD_CYCLE_TIME", "5", "HVDLITE_CYCLE_TIME", "5.0"),
])
def test_a_shaping_setting_on_rank_0_only_fails_init_on_every_rank(
        np: int, variable: str, value: str, setting: str, shown: str) -> None:
    proc = run_mpmd(np, {variable: value})
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    others = "1" if np == 2 else f"1-{np - 1}"
    for rank in range(np):
        line = next((l for l in proc.stdout.splitlines()
                     if l.startswith(f"REFUSED rank {rank}: ")), "")
        assert f"ConfigError: rank {rank}: hvdlite.init(): settings that must be the " \
               "same on every rank differ" in line, output
        assert f"{setting}: rank 0 {shown} ({variable}='{value}'), " \
               f"rank{'s' if np > 2 else ''} {others} " in line, output
    assert "STARTED" not in output and "DeadlockError" not in output, output


@pytest.mark.parametrize("np", [2, 4])
def test_a_rank_s_own_setting_starts_the_job_with_one_warning(np: int) -> None:
    proc = run_mpmd(np, {"HVDLITE_LOG_LEVEL": "info"})
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert all(f"STARTED rank {rank}" in proc.stdout for rank in range(np)), output
    warnings = [l for l in output.splitlines() if "settings differ between ranks" in l]
    assert len(warnings) == 1 and warnings[0].startswith("[hvdlite rank 0] WARNING"), output
    assert "HVDLITE_LOG_LEVEL: rank 0 'info' (HVDLITE_LOG_LEVEL='info')" in warnings[0], output
