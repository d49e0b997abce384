"""Outputs checked at init(), before the first step: a report directory, timeline
file or elastic state directory that rank 0 cannot write (a dangling symbolic link
and a FIFO timeline among them) fails hvd.init() on every rank with OutputPathError
(no rank is left waiting), or only warns with HVDLITE_OUTPUT_CHECK=warn; usable
paths pass, and the check leaves nothing behind. Later, a commit rank 0 cannot
write fails every rank and the job, and the job's end and its report say how many
commits reached the disk.

Paths that fail for root too (the tests may run as root, for whom permission bits
do not count): a path under a regular file, an existing file given as a directory,
a file in a missing directory. The job is tests/integration/outputs_job.py."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.mpirun import run_module

pytestmark = pytest.mark.timeout(120)


def run_job(np: int, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return run_module(np, "tests.integration.outputs_job",
                      {"HVDLITE_PEER_TIMEOUT": "5", **env}, timeout=60)


@pytest.mark.parametrize("np", [2, 4])
def test_unwritable_outputs_fail_init_on_every_rank(tmp_path: Path, np: int) -> None:
    afile = tmp_path / "afile"
    afile.write_text("keep me\n")
    env = {"HVDLITE_REPORT": str(afile),                                 # a file, not a dir
           "HVDLITE_TIMELINE": str(tmp_path / "missing" / "timeline.json"),
           "HVDLITE_ELASTIC_DIR": str(afile / "state")}                   # under a file
    proc = run_job(np, env)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    for rank in range(np):
        line = next((l for l in proc.stdout.splitlines()
                     if l.startswith(f"REFUSED rank {rank}: ")), "")
        assert "OutputPathError: " in line, output
        assert f"rank {rank}: hvdlite.init()" in line, output
        assert f"HVDLITE_REPORT='{afile}' cannot be used: {afile} exists and is not a " \
               "directory" in line, output
        assert f"its directory {tmp_path / 'missing'} does not exist" in line, output
        assert f"HVDLITE_ELASTIC_DIR='{afile / 'state'}' cannot be used: {afile} is a " \
               "file" in line, output
        assert "HVDLITE_OUTPUT_CHECK=warn" in line, output
    assert "STARTED" not in output, output
    assert afile.read_text() == "keep me\n" and sorted(os.listdir(tmp_path)) == ["afile"]


@pytest.mark.parametrize("variable,path", [
    ("HVDLITE_REPORT", "afile/report"),
    ("HVDLITE_TIMELINE", "afile/timeline.json"),
    ("HVDLITE_TIMELINE", "adir"),
])
def test_each_output_is_checked(tmp_path: Path, variable: str, path: str) -> None:
    (tmp_path / "afile").write_text("")
    (tmp_path / "adir").mkdir()
    proc = run_job(2, {variable: str(tmp_path / path)})
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert proc.stdout.count(f"OutputPathError: ") == 2, proc.stdout + proc.stderr
    assert f"{variable}='{tmp_path / path}' cannot be used" in proc.stdout, proc.stdout


def test_warn_setting_logs_and_starts_without_the_timeline(tmp_path: Path) -> None:
    timeline = tmp_path / "missing" / "timeline.json"
    proc = run_job(2, {"HVDLITE_TIMELINE": str(timeline), "HVDLITE_OUTPUT_CHECK": "warn"})
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert "STARTED rank 0" in output and "STARTED rank 1" in output, output
    assert f"rank 0: HVDLITE_TIMELINE='{timeline}' cannot be used" in output, output
    assert "no timeline is written" in output, output


def test_usable_outputs_start_and_the_check_creates_nothing(tmp_path: Path) -> None:
    report, state = tmp_path / "new" / "report", tmp_path / "deeper" / "new" / "state"
    proc = run_job(2, {"HVDLITE_REPORT": str(report), "HVDLITE_ELASTIC_DIR": str(state),
                       "HVDLITE_TIMELINE": str(tmp_path / "timeline.json"),
                       "OUTPUTS_ABSENT": os.pathsep.join([str(report), str(state)])})
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert "STARTED rank 0 created=[]" in output and "STARTED rank 1 created=[]" in output
    assert (report / "report.json").exists() and not state.parent.parent.exists(), output


# -- paths that passed the check and then lost data (issue 34, item 1) ---------------------
def _refusals(proc: subprocess.CompletedProcess[str], np: int) -> list[str]:
    """Every rank's REFUSED line (asserting there is one per rank, and no start)."""
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "STARTED" not in output, output
    lines = [next((l for l in proc.stdout.splitlines() if l.startswith(f"REFUSED rank {r}: ")),
                  "") for r in range(np)]
    assert all("OutputPathError: " in line for line in lines), output
    return lines


@pytest.mark.parametrize("np", [2, 4])
def test_dangling_symlinks_fail_init_on_every_rank(tmp_path: Path, np: int) -> None:
    gone = tmp_path / "gone"
    for name in ("report", "timeline.json", "state"):
        (tmp_path / f"link-{name}").symlink_to(gone / name)
    env = {"HVDLITE_REPORT": str(tmp_path / "link-report"),
           "HVDLITE_TIMELINE": str(tmp_path / "link-timeline.json"),
           "HVDLITE_ELASTIC_DIR": str(tmp_path / "link-state")}
    for rank, line in enumerate(_refusals(run_job(np, env), np)):
        assert f"rank {rank}: hvdlite.init()" in line, line
        for variable, name in (("HVDLITE_REPORT", "report"), ("HVDLITE_ELASTIC_DIR", "state")):
            link = tmp_path / f"link-{name}"
            assert f"{variable}='{link}' cannot be used: {link} is a symbolic link to " \
                   f"{gone / name}, which does not exist" in line, line
        link = tmp_path / "link-timeline.json"
        assert f"HVDLITE_TIMELINE='{link}' cannot be used: it is a symbolic link to " \
               f"{gone / 'timeline.json'}, and its directory {gone} does not exist" in line, line
    assert not gone.exists()                          # the check left nothing behind


@pytest.mark.parametrize("np", [2, 4])
def test_a_fifo_timeline_fails_init_on_every_rank_without_blocking(tmp_path: Path,
                                                                   np: int) -> None:
    fifo = tmp_path / "timeline.fifo"
    os.mkfifo(fifo)
    for line in _refusals(run_job(np, {"HVDLITE_TIMELINE": str(fifo)}), np):
        assert f"HVDLITE_TIMELINE='{fifo}' cannot be used: {fifo} is a FIFO, not a regular " \
               "file" in line, line
    assert sorted(os.listdir(tmp_path)) == ["timeline.fifo"]


def test_a_commit_that_fails_later_fails_every_rank_and_the_job(tmp_path: Path) -> None:
    state = tmp_path / "state"
    proc = run_job(2, {"HVDLITE_ELASTIC_DIR": str(state), "OUTPUTS_COMMITS": "3",
                       "OUTPUTS_FULL_AT": "2"})
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "COMMITTED" not in output, output
    for rank in range(2):
        line = next((l for l in proc.stdout.splitlines()
                     if l.startswith(f"COMMIT FAILED rank {rank}: ")), "")
        assert f"StateWriteError: rank {rank}: commit 2 did not reach the disk" in line, output
        assert f"{state / 'state.hvd'} (No space left on device)" in line, output
        assert "HVDLITE_ELASTIC_DIR holds commit 1, which a restart resumes from" in line, \
            output
    from hvdlite.elastic import persist
    assert persist.read(str(state))[1] == 1          # the last good commit stands


def test_the_report_and_the_summary_say_how_many_commits_reached_the_disk(
        tmp_path: Path) -> None:
    state, report = tmp_path / "state", tmp_path / "report"
    proc = run_job(2, {"HVDLITE_ELASTIC_DIR": str(state), "HVDLITE_REPORT": str(report),
                       "HVDLITE_ELASTIC_PERSIST_EVERY": "2", "OUTPUTS_COMMITS": "5"})
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    told = (f"elastic: 2 of 5 commits reached the disk (every 2nd: "
            f"HVDLITE_ELASTIC_PERSIST_EVERY=2); HVDLITE_ELASTIC_DIR={state} holds commit 4")
    assert proc.stdout.count(f"[hvdlite] {told}") == 1, output      # rank 0, at the end
    assert told in (report / "report.txt").read_text()
    written = json.loads((report / "report.json").read_text())["elastic"]
    assert (written["commits"], written["written"], written["on_disk"]) == (5, 2, 4)
