"""Whole MPI jobs: failure propagation, stall shutdown, peer shutdown, env knobs."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hvdlite.runner.mpi_impl import env_arguments
from tests.mpirun import launcher, mpiexec

ROOT = Path(__file__).resolve().parents[2]


def run_job(job: str, np: int, env: dict[str, str] | None = None,
            timeout: float = 60) -> tuple[subprocess.CompletedProcess[str], float]:
    full_env = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    start = time.monotonic()
    proc = subprocess.run([*mpiexec(np), sys.executable, "-m",
                           "tests.integration.jobs", job], cwd=ROOT, env=full_env,
                          capture_output=True, text=True, timeout=timeout)
    return proc, time.monotonic() - start


@pytest.mark.parametrize("np", [2, 4])
def test_uncaught_exception_ends_the_job_quickly(np: int) -> None:
    """Within 10 s of the exception (the rank says when, on the host's monotonic
    clock), not after the peer timeout (20 s): a slow start does not count."""
    proc, _ = run_job("crash", np)
    ended = time.monotonic()
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    raised = re.search(r"LOSING rank \d+ at ([\d.]+)", output)
    assert raised, output
    assert ended - float(raised[1]) < 10, f"took {ended - float(raised[1]):.1f} s"
    assert output.count("RuntimeError: deliberate failure on the last rank") == 1, output
    assert f"rank {np - 1} of {np}" in output


@pytest.mark.parametrize("np", [2, 4])
def test_stall_shutdown_errors_on_every_rank(np: int) -> None:
    proc, elapsed = run_job("stall_shutdown", np, {"HVDLITE_STALL_CHECK_TIME": "0.5",
                                                   "HVDLITE_STALL_SHUTDOWN_TIME": "1.5"})
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    for rank in range(np):
        assert f"STALL_ERROR rank {rank}" in output, output
    assert "'lonely'" in output and f"missing ranks: {list(range(1, np))}" in output


@pytest.mark.parametrize("np", [2, 4])
def test_collectives_after_a_peer_shutdown_fail_clearly(np: int) -> None:
    proc, _ = run_job("early_shutdown", np)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    for rank in range(1, np):
        assert f"SHUTDOWN_ERROR rank {rank}: hvdlite was shut down on rank(s) [0]" in output


@pytest.mark.parametrize("np", [2, 4])
def test_a_shutdown_frees_a_lane_that_some_ranks_let_go_of(np: int) -> None:
    proc, _ = run_job("lane_kept_on_some_ranks", np)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    for rank in range(np):
        assert f"LANES rank {rank}: 0 held after shutdown" in output, output


@pytest.mark.parametrize("prefix", ["HVDLITE", "HOROVOD"])
def test_timeline_from_environment(tmp_path: Path, prefix: str) -> None:
    """hvdlite's variables or Horovod's, which Horovod's job files set; Horovod's names."""
    path = tmp_path / "trace.json"
    proc, _ = run_job("timeline_env", 2, {f"{prefix}_TIMELINE": str(path),
                                          f"{prefix}_TIMELINE_MARK_CYCLES": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    events = json.loads(path.read_text())
    names = {e.get("name") for e in events} | {
        e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert {"allreduce.env.timeline", "NEGOTIATE_ALLREDUCE", "ALLREDUCE", "QUEUE",
            "MEMCPY_IN_FUSION_BUFFER", "MPI_ALLREDUCE", "MEMCPY_OUT_FUSION_BUFFER",
            "CYCLE_START"} <= names, sorted(names)


def test_numpy_demo_trains_identically_on_all_ranks() -> None:
    proc = subprocess.run([*mpiexec(2), sys.executable, "examples/numpy_allreduce.py"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "parameters identical on all ranks: True" in proc.stdout
    error = float(proc.stdout.split("|w - w_true| = ")[1].split(";")[0])
    assert error < 0.05


# Two ranks, as make demo runs it (four train the same way: tests/mpi's training
# comparisons run at -n 4; SLURM's template test runs the example too).
@pytest.mark.timeout(320)     # above the job's own limit, 300 s
@pytest.mark.parametrize("np", [2])
def test_pytorch_digits_example_reaches_accuracy(np: int) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    proc = subprocess.run([*mpiexec(np), sys.executable, "examples/pytorch_digits.py"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    accuracy = float(proc.stdout.rsplit("test accuracy ", 1)[1].split()[0])
    assert accuracy >= 0.95, proc.stdout


@pytest.mark.timeout(150)     # above the job's own limit, 120 s
def test_pytorch_synthetic_benchmark_runs() -> None:
    pytest.importorskip("torch")
    proc = subprocess.run([*mpiexec(2), sys.executable, "examples/pytorch_synthetic_benchmark.py",
                           "--model", "mlp", "--fp16-allreduce", "--num-warmup-batches", "1",
                           "--num-batches-per-iter", "2", "--num-iters", "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Total img/sec on 2 rank(s):" in proc.stdout


def _hvdliterun(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hvdlite.run", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))


@pytest.mark.parametrize("np", [2, 4])
def test_hvdliterun_runs_the_job_and_passes_knobs(np: int, tmp_path: Path) -> None:
    trace = tmp_path / "trace.json"
    proc = _hvdliterun("-np", str(np), "--timeline-filename", str(trace), sys.executable,
                       "examples/numpy_allreduce.py", "--steps", "20")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{np} ranks, 20 steps" in proc.stdout
    assert json.loads(trace.read_text())          # HVDLITE_TIMELINE reached the ranks


@pytest.mark.parametrize("hosts", ["-H", "--hostfile"])
def test_hvdliterun_with_hosts(hosts: str, tmp_path: Path) -> None:
    """Two slots on this host, given inline or in a hostfile of the launcher's format."""
    if hosts == "-H":
        where = ["-H", "localhost:2"]
    else:
        hostfile = tmp_path / "hosts"
        hostfile.write_text("localhost slots=2\n" if launcher().flavor == "openmpi"
                            else "localhost:2\n")
        where = ["--hostfile", str(hostfile)]
    proc = _hvdliterun("-np", "2", *where, sys.executable, "examples/numpy_allreduce.py",
                       "--steps", "5")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 ranks, 5 steps" in proc.stdout and "parameters identical on all ranks: True" \
        in proc.stdout


def test_hvdliterun_exit_code_is_the_jobs() -> None:
    proc = _hvdliterun("-np", "2", sys.executable, "-m", "tests.integration.jobs", "crash")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "deliberate failure" in proc.stderr + proc.stdout
    proc = _hvdliterun("-np", "2", sys.executable, "-m", "tests.integration.jobs", "exit_status")
    assert proc.returncode == 3, proc.stdout + proc.stderr     # the rank's sys.exit(3)


def test_hvdliterun_dry_run_and_check() -> None:
    proc = _hvdliterun("-np", "3", "--cycle-time-ms", "2", "--dry-run", "python", "x.py")
    assert proc.returncode == 0 and " -n 3 " in proc.stdout
    knob = " ".join(env_arguments(launcher().flavor, {"HVDLITE_CYCLE_TIME": "2.0"}))
    assert knob in proc.stdout and proc.stdout.strip().endswith("python x.py")
    check = _hvdliterun("--check")
    assert check.returncode == 0 and "MPI library:" in check.stdout and "torch:" in check.stdout
    name, plugin = ("Open MPI", "pmix") if launcher().flavor == "openmpi" else ("MPICH", "pmi2")
    assert f"({name})" in check.stdout and f"srun --mpi={plugin}" in check.stdout, check.stdout
