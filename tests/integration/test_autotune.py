"""HVDLITE_AUTOTUNE end to end under mpiexec (tests/integration/autotune_job.py): the
search ends at the same step with the same settings on every rank, rank 0 writes
every trial and the choice to HVDLITE_AUTOTUNE_LOG (or Horovod's HOROVOD_AUTOTUNE_LOG),
the report says what was chosen and why, and a log path that cannot be written fails
init() on every rank. What is chosen depends on this machine's timings, so the tests
check agreement and bookkeeping, never which setting won."""
from __future__ import annotations

import csv
import json
import subprocess
from pathlib import Path

import pytest

from hvdlite.policy.tuning import TUNED
from tests.integration.test_outputs import run_job
from tests.mpirun import run_module

pytestmark = pytest.mark.timeout(300)


def _run(np: int, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return run_module(np, "tests.integration.autotune_job",
                      {"HVDLITE_AUTOTUNE_WARMUP_STEPS": "2", **env}, timeout=280)


@pytest.mark.parametrize("np", [2, 4])
def test_every_rank_ends_on_the_logged_choice(tmp_path: Path, np: int) -> None:
    log, report = tmp_path / "autotune.csv", tmp_path / "report"
    proc = _run(np, {"HVDLITE_AUTOTUNE": "1", "HVDLITE_AUTOTUNE_LOG": str(log),
                     "HVDLITE_REPORT": str(report)})
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    done = sorted(line.split(" ", 5) for line in proc.stdout.splitlines()
                  if line.startswith("DONE rank "))
    assert [int(d[2]) for d in done] == list(range(np)), output
    assert len({(d[4], d[5]) for d in done}) == 1, output       # same steps, same settings
    settings = json.loads(done[0][5].split(" ", 1)[1])
    with open(log, newline="") as handle:
        rows = list(csv.reader(handle))
    header, trials, chosen = rows[0], rows[1:-1], rows[-1]
    assert header == ["trial", "phase", *TUNED, "steps", "step_ms", "rank_step_ms", "decision"]
    assert [int(r[0]) for r in trials] == list(range(len(trials))) and trials[0][1] == "baseline"
    assert all(len(r[header.index("rank_step_ms")].split(";")) == np for r in trials)
    assert chosen[:2] == ["chosen", "final"] and chosen[-1], chosen
    assert int(chosen[header.index("steps")]) == int(done[0][4])
    for name in TUNED:
        assert float(chosen[header.index(name)]) == float(settings[name]), (name, chosen)
    text = (report / "report.txt").read_text()
    assert "autotune: " in text and f"after {len(trials)} trials" in text, text


def test_horovods_variables_turn_it_on_and_name_the_log(tmp_path: Path) -> None:
    log = tmp_path / "horovod.csv"
    proc = _run(2, {"HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_LOG": str(log)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert log.read_text().splitlines()[-1].startswith("chosen,final,")


@pytest.mark.parametrize("np", [2, 4])
def test_a_log_that_cannot_be_written_fails_init_on_every_rank(tmp_path: Path, np: int) -> None:
    log = tmp_path / "missing" / "autotune.csv"
    proc = run_job(np, {"HVDLITE_AUTOTUNE": "1", "HVDLITE_AUTOTUNE_LOG": str(log)})
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    refused = [l for l in proc.stdout.splitlines() if l.startswith("REFUSED rank ")]
    assert len(refused) == np, output
    for line in refused:
        assert "OutputPathError: " in line, output
        assert (f"HVDLITE_AUTOTUNE_LOG='{log}' cannot be used: its directory "
                f"{tmp_path / 'missing'} does not exist") in line, output
    assert "STARTED" not in output and not log.parent.exists()


def test_the_log_is_not_checked_without_autotune(tmp_path: Path) -> None:
    proc = run_job(2, {"HVDLITE_AUTOTUNE_LOG": str(tmp_path / "missing" / "autotune.csv")})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("STARTED rank") == 2
