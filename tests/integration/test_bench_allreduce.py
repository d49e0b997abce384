"""``python -m bench allreduce`` under mpiexec: the lone-op and per-tensor
figures come with their baselines, torch.distributed over gloo among them."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MPIEXEC = str(Path(sys.executable).with_name("mpiexec"))
FIGURE = r"(\d+\.\d+) (us|ms)"


def _bench(*args: str, np: int = 2) -> str:
    proc = subprocess.run(
        [MPIEXEC, "-n", str(np), sys.executable, "-m", "bench", "allreduce", *args],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True,
        text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.timeout(200)
def test_the_lone_op_is_printed_beside_raw_mpi_the_floors_and_gloo() -> None:
    pytest.importorskip("torch.distributed")
    out = _bench("--only", "lone", "--lone-repeats", "5")
    assert re.search(rf"hvdlite {FIGURE}, raw mpi4py {FIGURE}", out), out
    assert re.search(rf"agreement round before it.*: {FIGURE}", out), out
    assert re.search(rf"over gloo, the same op: {FIGURE} \(hvdlite \d+\.\d+x its speed\)", out), out


@pytest.mark.timeout(200)
def test_the_two_hundred_small_ops_are_printed_beside_gloos() -> None:
    pytest.importorskip("torch.distributed")
    out = _bench("--only", "small", "--seconds", "0.01")
    assert re.search(rf"200 x 4 KiB async allreduces: {FIGURE}; one 800 KiB", out), out
    assert re.search(rf"over gloo, the same 200 async: {FIGURE}; one 800 KiB: {FIGURE}; "
                     r"ratio \d+\.\d+", out), out


@pytest.mark.timeout(200)
def test_an_op_on_a_set_while_a_rank_idles_is_timed() -> None:
    out = _bench("--only", "set", "--lone-repeats", "5")
    assert re.search(r"on the set \[0\] while rank 1 idles \(median of 5\): \d+ us, p90 \d+ us", out), out


@pytest.mark.timeout(200)
def test_an_op_on_a_set_at_one_rank_is_skipped_with_the_reason() -> None:
    out = _bench("--only", "set", "--lone-repeats", "5", np=1)
    assert "while a rank outside it idles: skipped (needs 2 ranks or more)" in out, out
