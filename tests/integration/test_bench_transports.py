"""The benchmarks' torch transport for real, at their smallest: ``bench allreduce
--transports mpi torch`` and ``bench training`` with hvdlite_gloo each launch hvdlite
under mpiexec and under torchrun and print the side-by-side rows (smoke runs: the
figures mean nothing at these sizes)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch.distributed", reason="the torch transport needs torch")
ROOT = Path(__file__).resolve().parents[2]
RATIO = r"\d+\.\d+x \(\d+\.\d+-\d+\.\d+\)"


def _bench(*args: str) -> str:
    """The driver itself runs without a launcher: it launches mpiexec and torchrun."""
    proc = subprocess.run([sys.executable, "-m", "bench", *args], cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=280,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.timeout(300)
def test_allreduce_prints_each_figure_on_both_transports_with_the_ratios() -> None:
    out = _bench("allreduce", "--transports", "mpi", "torch", "--np", "2", "--rounds", "2",
                 "--seconds", "0.01", "--lone-repeats", "3", "--max-mib", "1")
    assert "hvdlite mpi" in out and "hvdlite torch" in out and "torch gloo" in out, out
    for figure in ("lone 4-byte op", "1 MiB", "200 x 4 KiB async"):
        row = next((l for l in out.splitlines() if figure in l), "")
        assert re.search(rf"\| +{RATIO} \| {RATIO}$", row), out


@pytest.mark.timeout(300)
def test_training_runs_hvdlite_on_the_gloo_transport_beside_mpi() -> None:
    out = _bench("training", "--np", "2", "--models", "mlp", "--methods", "hvdlite",
                 "hvdlite_gloo", "--rounds", "1", "--seconds", "0.2", "--warmup-seconds", "0.3")
    assert "timed after 0.3 s of untimed training" in out, out
    assert re.search(r"hvdlite_gloo: +\d+\.\d", out), out
    assert re.search(r"gloo-transport/MPI: \d+\.\d+x", out), out
    assert "gloo-transport/DDP:" not in out                # DDP did not run: no ratio


@pytest.mark.timeout(120)
def test_a_training_worker_warms_up_for_the_seconds_asked_before_timing() -> None:
    """--warmup-seconds reaches the worker under mpiexec and it trains untimed before
    its timed loop. How many steps fit in the time is the machine's business: the
    warm-up's length and order are checked on a fake clock
    (tests/unit/test_bench_training_methods.py)."""
    import json
    from bench.launches import mpiexec_path
    proc = subprocess.run([mpiexec_path(), "-n", "2", sys.executable, "-m", "bench",
                           "training-worker", "--method", "no_comm", "--model", "mlp",
                           "--seconds", "0.2", "--warmup-seconds", "0.5"],
                          cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=100, stdin=subprocess.DEVNULL)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line, proc.stdout + proc.stderr
    assert json.loads(line[len("RESULT "):])["warmup_steps"] >= 1, line
