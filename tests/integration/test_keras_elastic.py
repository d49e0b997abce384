"""hvdliterun --elastic on a whole Keras job: rank 1 SIGKILLs itself after a
mid-epoch commit inside model.fit; the restarted job resumes from the committed
epoch and batch and ends with bitwise the model and optimizer variables (the
iteration counter included) of an uninterrupted run.

The program is tests/integration/keras_elastic_jobs.py (deterministic data, no
shuffling). TensorFlow takes seconds to import, so there are two launches only.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")
if keras.backend.backend() != "tensorflow":
    pytest.skip("this job runs Keras on the TensorFlow backend", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(400)


def train(tmp_path: Path, name: str, **env: str) -> tuple[subprocess.CompletedProcess[str],
                                                           dict[str, Any]]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    out = tmp_path / f"{name}.json"
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("HVDLITE_")}
    full_env.update(PYTHONPATH=str(ROOT), HVDLITE_PEER_TIMEOUT="5", TF_CPP_MIN_LOG_LEVEL="2",
                    ELASTIC_MARKER=str(tmp_path / "fired"), ELASTIC_OUT=str(out), **env)
    proc = subprocess.run([sys.executable, "-m", "hvdlite.run", "-np", "2", "--elastic",
                           "--max-restarts", "2", sys.executable, "-m",
                           "tests.integration.keras_elastic_jobs", "train"],
                          cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=360)
    return proc, json.loads(out.read_text()) if out.exists() else {}


def _starts(proc: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in proc.stdout.splitlines() if line.startswith("START")]


def test_killed_rank_restarts_mid_epoch_and_ends_bitwise_as_uninterrupted(
        tmp_path: Path) -> None:
    proc, reference = train(tmp_path / "reference", "reference")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _starts(proc) == ["START commits=0 epoch=0 batch=0"], proc.stdout
    # 3 epochs of 6 batches: 6 steps * 3 epochs applied, committed every 2 batches.
    assert reference["iterations"] == 18 and reference["epoch"] == 3

    proc, result = train(tmp_path / "killed", "killed", ELASTIC_FAULT="kill_after_commit",
                         ELASTIC_FAULT_AT="5")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert (tmp_path / "killed" / "fired").exists(), output
    assert "restart 1 of 2" in output
    # Commit 5 is epoch 1's second batch commit (4 commits per epoch): mid-epoch.
    assert _starts(proc) == ["START commits=0 epoch=0 batch=0",
                             "START commits=5 epoch=1 batch=2"], output
    assert result["iterations"] == reference["iterations"]
    assert result["variables"] == reference["variables"]
