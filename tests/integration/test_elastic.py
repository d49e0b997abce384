"""hvdliterun --elastic on whole jobs: a rank killed after a commit, a rank killed
inside commit()'s write, preemption and resuming, and restarts exhausted.

The training program is tests/integration/elastic_jobs.py (deterministic: same
data order and arithmetic in every run), so a recovered run must end with
bitwise the parameters of an uninterrupted one.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(240)
SAMPLES = 48


def hvdliterun(tmp_path: Path, job: str, options: list[str], env: dict[str, str],
               timeout: float = 200) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("HVDLITE_")}
    full_env.update(PYTHONPATH=str(ROOT), HVDLITE_PEER_TIMEOUT="5",
                    ELASTIC_MARKER=str(tmp_path / "fired"), **env)
    return subprocess.run([sys.executable, "-m", "hvdlite.run", "-np", "2", "--elastic",
                           *options, sys.executable, "-m", "tests.integration.elastic_jobs",
                           job], cwd=ROOT, env=full_env, capture_output=True, text=True,
                          timeout=timeout)


def train(tmp_path: Path, name: str, options: list[str] = ["--max-restarts", "2"],
          **env: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    out = tmp_path / f"{name}.json"
    proc = hvdliterun(tmp_path, "train", options, dict(env, ELASTIC_OUT=str(out)))
    result = json.loads(out.read_text()) if out.exists() else {}
    return proc, result


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    proc, result = train(tmp_path_factory.mktemp("reference"), "reference")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return result


def _starts(proc: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in proc.stdout.splitlines() if line.startswith("START")]


def test_killed_rank_restarts_and_ends_bitwise_as_uninterrupted(
        tmp_path: Path, reference: dict[str, Any]) -> None:
    proc, result = train(tmp_path, "killed", ELASTIC_FAULT="kill_after_commit",
                         ELASTIC_FAULT_AT="5")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert (tmp_path / "fired").exists(), output
    assert "restart 1 of 2" in output
    assert _starts(proc) == ["START commits=0 epoch=0 processed=0",
                             "START commits=5 epoch=1 processed=16"], output
    assert result["params"] == reference["params"]
    assert result["seen"] == reference["seen"]


def test_shuffled_resumed_epoch_sees_every_sample_once(tmp_path: Path) -> None:
    proc, result = train(tmp_path, "shuffled", ELASTIC_FAULT="kill_after_commit",
                         ELASTIC_FAULT_AT="5", ELASTIC_SHUFFLE="1")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert "START commits=5 epoch=1 processed=16" in proc.stdout, output
    by_epoch: dict[int, list[int]] = {}
    for epoch, *indices in result["seen"]:
        by_epoch.setdefault(epoch, []).extend(indices)
    assert sorted(by_epoch) == [0, 1, 2]
    for epoch, indices in by_epoch.items():
        assert sorted(indices) == list(range(SAMPLES)), (epoch, indices)
    assert by_epoch[0] != by_epoch[1]              # it did shuffle, per epoch


def test_kill_inside_commit_write_keeps_and_uses_the_previous_state(
        tmp_path: Path, reference: dict[str, Any]) -> None:
    proc, result = train(tmp_path, "torn", ELASTIC_FAULT="kill_in_write", ELASTIC_FAULT_AT="5")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert (tmp_path / "fired").exists(), output
    # Commit 5 never reached the file: the restart resumes from commit 4.
    assert _starts(proc)[-1] == "START commits=4 epoch=1 processed=0", output
    assert result["params"] == reference["params"]


def test_preempted_job_exits_for_requeue_and_resumes(tmp_path: Path,
                                                     reference: dict[str, Any]) -> None:
    state_dir = str(tmp_path / "state")
    # Rank 1 alone gets SIGUSR1 after commit 5; the ranks agree on it at commit 6.
    proc, result = train(tmp_path, "preempted", ELASTIC_FAULT="preempt", ELASTIC_FAULT_AT="5",
                         HVDLITE_ELASTIC_DIR=state_dir, HVDLITE_ELASTIC_PERSIST_EVERY="4")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 75, output
    assert "preempted: the last commit is saved" in output and not result
    proc, result = train(tmp_path, "resumed", HVDLITE_ELASTIC_DIR=state_dir,
                         HVDLITE_ELASTIC_PERSIST_EVERY="4")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # Commit 6 is not a multiple of 4, yet preemption wrote it.
    assert _starts(proc) == ["START commits=6 epoch=1 processed=32"], proc.stdout
    assert result["params"] == reference["params"]


def test_restarts_exhausted_print_the_error_once_and_fail(tmp_path: Path) -> None:
    proc = hvdliterun(tmp_path, "fail_always", ["--max-restarts", "2"], {})
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert output.count("ValueError: deliberate bug in the training script") == 1, output
    assert "restart 2 of 2" in output
    assert output.count("giving up after 2 restart(s)") == 1, output


def test_bad_elastic_arguments_are_refused() -> None:
    for options, message in [(["--max-restarts", "-1"], "--max-restarts must be >= 0"),
                             (["--min-np", "3"], "--min-np must be between 1 and -np"),
                             (["--elastic", "--host-discovery-script", "x", "-H", "a:2"],
                              "not both")]:
        argv = ["-np", "2"] + (options if "--elastic" in options else ["--elastic"] + options)
        proc = subprocess.run([sys.executable, "-m", "hvdlite.run", *argv, "true"], cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_hvdlite_run_returns_results_by_rank() -> None:
    import hvdlite
    from tests.integration import elastic_jobs
    assert hvdlite.run(elastic_jobs.rank_times, args=(3,), kwargs={"offset": 1}, np=2) == [
        (0, 4.0), (1, 4.0)]
    with pytest.raises(hvdlite.UsageError, match="top level"):
        hvdlite.run(lambda: 1, np=2)
