"""Whole jobs whose program sets mpi4py.rc.initialize = False (as Horovod's tests do):
hvd.init() initialises MPI itself at a thread level its engine thread can use and
finalizes it at exit; MPI the program initialised stays the program's; a refused
init(process_sets=...) leaves nothing started, so a corrected call works."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.mpirun import mpiexec

ROOT = Path(__file__).resolve().parents[2]


def run_job(job: str, np: int, env: dict[str, str] | None = None) -> str:
    """The job's output; it must end with status 0 within 60 s."""
    full_env = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    proc = subprocess.run([*mpiexec(np), sys.executable, "-m", "tests.integration.mpi_init_jobs",
                           job], cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=60)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    return output


@pytest.mark.parametrize("np", [2, 4])
def test_hvdlite_initialises_mpi_left_to_it_and_finalizes_it_at_exit(np: int) -> None:
    output = run_job("left_to_hvdlite", np, {"JOB_SIZE": str(np)})
    for rank in range(np):
        assert (f"REFUSED rank {rank} initialized=False: rank {rank}: hvdlite.init(process_sets"
                f"=...): entry 1, ranks {list(range(np))}, duplicates the global process set"
                in output), output
        assert f"STARTED rank {rank} level=multiple ids=[1, 2]" in output, output
        # The last rank outlived the others' exit: they finalized MPI instead of ending
        # without it, which makes the launcher kill every rank still running.
        assert f"DONE rank {rank}" in output, output
        assert f"AT_EXIT rank {rank} finalized=True" in output, output


def test_mpi4pys_thread_level_is_asked_for_raised_to_what_the_engine_needs() -> None:
    output = run_job("left_to_hvdlite", 2, {"JOB_SIZE": "2", "JOB_THREAD_LEVEL": "funneled"})
    assert "STARTED rank 0 level=serialized" in output, output


def test_mpi_the_program_initialised_is_checked_and_left_for_it_to_finalize() -> None:
    output = run_job("too_low_a_thread_level", 2)
    for rank in range(2):
        assert (f"REFUSED rank {rank}: rank {rank}: MPI runs at thread level 'funneled'"
                in output), output
    output = run_job("initialized_by_the_program", 2)
    for rank in range(2):
        assert f"BEFORE_FINALIZE rank {rank} finalized=False" in output, output
        assert f"AT_EXIT rank {rank} finalized=True" in output, output
