"""The report's rules on made-up records (no MPI): stragglers, verdicts, the
recorder's step window, the peer-wait clock, the files, and hvdliterun --report."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hvdlite.diagnostics import report, report_summary
from hvdlite.recording.recorder import PeerWaitClock, StepRecorder
from hvdlite.runner import launch
from tests.unit.test_runner import _fake_launcher


def record(rank: int, peer_wait: float, step: float = 0.1, optimizer_wait: float = 0.01,
           rss: int = 300 << 20, **extra: Any) -> dict[str, Any]:
    return {"rank": rank, "host": "h", "steps": 20, "step_time_s": step,
            "optimizer_wait_s": optimizer_wait, "other_wait_s": 0.0,
            "peer_wait_s": peer_wait, "bytes_sent": 1000.0, "bytes_received": 1000.0,
            "bytes_estimated": False, "other_calls": 0, "total_bytes_sent": 10,
            "total_bytes_received": 10, "rss_peak_bytes": rss, "gpu_mem_peak_bytes": None,
            "gpu_util": None, "gpu_note": "not measured: pynvml is not installed", **extra}


@pytest.mark.parametrize("size", [2, 3, 4, 8])
@pytest.mark.parametrize("slow", [0, 1])
def test_the_rank_the_others_wait_for_is_the_straggler(size: int, slow: int) -> None:
    records = [record(r, 0.002 if r == slow else 0.052, optimizer_wait=0.002 if r == slow
                      else 0.055) for r in range(size)]
    summary = report_summary.summarize(records)
    assert summary["stragglers"] == [slow]
    assert summary["verdict"].startswith(f"rank {slow} is 50 ms slower per step")
    assert summary["ranks"][slow]["waiting_for_peers_s"] == 0.0
    others = [r for r in summary["ranks"] if r["rank"] != slow]
    assert all(abs(r["waiting_for_peers_s"] - 0.050) < 1e-9 for r in others)


def test_noise_below_the_threshold_names_nobody() -> None:
    # 4 ms apart on a 100 ms step: under max(5 ms, 10 ms).
    summary = report_summary.summarize([record(0, 0.010), record(1, 0.014), record(2, 0.012),
                                        record(3, 0.011)])
    assert summary["stragglers"] == []
    assert summary["verdict"].startswith("well balanced")


def test_the_threshold_grows_with_the_step() -> None:
    # 30 ms apart is a straggler on a 100 ms step, not on a 1 s one.
    assert report_summary.summarize([record(0, 0.031), record(1, 0.001)])["stragglers"] == [1]
    assert report_summary.summarize([record(0, 0.031, step=1.0),
                                     record(1, 0.001, step=1.0)])["stragglers"] == []


def test_a_fast_rank_is_not_a_straggler() -> None:
    """Rank 0 has less work: it waits for everyone, nobody waits for it."""
    records = [record(0, 0.060)] + [record(r, 0.010) for r in range(1, 4)]
    assert report_summary.summarize(records)["stragglers"] == []


def test_communication_heavy_verdict() -> None:
    records = [record(r, 0.001, optimizer_wait=0.040) for r in range(4)]
    summary = report_summary.summarize(records)
    assert summary["comm_share"] == pytest.approx(0.40)
    assert summary["verdict"] == ("communication costs 40% of each step: raise the batch "
                                  "per rank or the fusion threshold")


def test_memory_imbalance_is_reported() -> None:
    summary = report_summary.summarize([record(0, 0.001, rss=900 << 20), record(1, 0.001)])
    assert summary["memory"]["rss_max_rank"] == 0
    assert summary["memory"]["imbalance"] == pytest.approx(3.0)
    assert "3.0x the memory of rank 1" in summary["verdict"]


def test_no_steps_is_said_not_judged() -> None:
    summary = report_summary.summarize([{**record(0, 0.0), "steps": 0},
                                        {**record(1, 0.0), "steps": 0}])
    assert summary["stragglers"] == [] and summary["comm_share"] is None
    assert summary["verdict"].startswith("no optimizer steps")
    assert summary["ranks"][0]["step_time_s"] is None


def test_recorder_window_excludes_setup_and_counts_waits() -> None:
    totals = iter([(5.0, 100, 100, 0), (5.5, 300, 400, 0), (6.0, 500, 700, 50)])
    recorder = StepRecorder(lambda: next(totals))
    recorder.collective_wait(9.0)              # set-up, before the first boundary: outside
    recorder.step_done()
    started = recorder.optimizer_wait_begin()
    recorder.collective_wait(1.0)              # inside the optimizer: counted once, there
    recorder.optimizer_wait_end(started)
    recorder.collective_wait(0.25)             # a metric allreduce: 'other'
    recorder.step_done()
    recorder.step_done()
    window = recorder.window()
    assert window["steps"] == 2
    assert window["peer_wait_s"] == pytest.approx(0.5)
    assert window["other_wait_s"] == pytest.approx(0.125)
    assert window["bytes_sent"] == 200 and window["bytes_received"] == 300
    assert window["bytes_estimated"] is True
    assert 0 <= window["optimizer_wait_s"] < 0.1
    assert recorder.other_calls == 2


def test_peer_wait_clock_counts_no_time_twice() -> None:
    clock = PeerWaitClock()
    clock.submitted(1.0)
    clock.submitted(1.5)          # another request while one waits: same interval
    clock.settled(2.0)
    clock.submitted(1.8)          # queued before the close, drained after it
    clock.settled(2.5)
    assert clock.total == pytest.approx(1.5)


def test_write_makes_json_text_and_png(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("matplotlib")
    records = [record(0, 0.052), record(1, 0.002)]
    report.write(records, str(tmp_path / "out"))
    loaded = json.loads((tmp_path / "out" / "report.json").read_text())
    assert loaded["stragglers"] == [1] and len(loaded["ranks"]) == 2
    text = (tmp_path / "out" / "report.txt").read_text()
    assert "verdict: rank 1 is" in text and text == capsys.readouterr().out
    assert (tmp_path / "out" / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_hvdliterun_report_sets_the_variable(tmp_path: Path) -> None:
    args = launch.parser().parse_args([
        "-np", "2", "--report", "/tmp/rep", "--mpiexec",
        _fake_launcher(tmp_path, "HYDRA Version: 4"), "python", "train.py"])
    command = launch.build_command(args)
    assert command[command.index("HVDLITE_REPORT") + 1] == "/tmp/rep"
