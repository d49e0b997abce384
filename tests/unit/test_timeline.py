"""The Chrome-trace timeline, without MPI: the events it writes, their times and
thread ids, and a file that is a valid JSON array after every event."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from hvdlite.core import timeline as timeline_module
from hvdlite.core.timeline import Timeline


def events_when(path: Path, count: int) -> list[dict]:
    """The file's events once it holds ``count`` (the writer is a thread). The file is
    valid JSON after every write; a read that races with a write (one ``pwrite``, which
    a concurrent read may see half done) is read again, a few times at most."""
    deadline = time.monotonic() + 10
    torn = 0
    while True:
        try:
            events = json.loads(path.read_bytes())
        except json.JSONDecodeError:
            torn += 1
            assert torn < 20, "the trace stayed invalid JSON between writes"
            time.sleep(0.001)
            continue
        if len(events) >= count or time.monotonic() > deadline:
            return events
        time.sleep(0.001)


@pytest.fixture
def origin(monkeypatch: pytest.MonkeyPatch) -> float:
    """Timelines made in the test start at monotonic time 1000."""
    monkeypatch.setattr(timeline_module, "time", SimpleNamespace(monotonic=lambda: 1000.0))
    return 1000.0


@pytest.mark.timeout(30)
def test_spans_have_times_in_microseconds_from_the_start_and_their_args(
        tmp_path: Path, origin: float) -> None:
    path = tmp_path / "t.json"
    mask = os.umask(0o022)
    try:
        timeline = Timeline(str(path), rank=3)
    finally:
        os.umask(mask)
    timeline.span("grad", "allreduce", origin + 2.0, origin + 2.5, {"bytes": 16})
    timeline.span("grad", "queue", origin + 1.234567e-6, origin + 1.0)
    timeline.span("grad", "memcpy", origin + 3.0, origin + 2.0)  # a clock step back: dur 0
    timeline.close()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644   # a new file: rw-r--r--
    events = json.loads(path.read_bytes())
    assert events[:2] == [
        {"name": "process_name", "ph": "M", "pid": 3, "tid": 0,
         "args": {"name": "hvdlite rank 3"}},
        {"name": "thread_name", "ph": "M", "pid": 3, "tid": 1, "args": {"name": "grad"}}]
    assert events[2:] == [
        {"name": "allreduce", "ph": "X", "pid": 3, "tid": 1, "ts": 2e6, "dur": 5e5,
         "args": {"bytes": 16, "tensor": "grad"}},
        {"name": "queue", "ph": "X", "pid": 3, "tid": 1, "ts": 1.235, "dur": 999998.765,
         "args": {"tensor": "grad"}},
        {"name": "memcpy", "ph": "X", "pid": 3, "tid": 1, "ts": 3e6, "dur": 0.0,
         "args": {"tensor": "grad"}}]


@pytest.mark.timeout(30)
def test_each_tensor_gets_its_own_thread_named_once(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    timeline = Timeline(str(path))
    for tensor in ("a", "b", "a", "c", "b"):
        timeline.span(tensor, "allreduce", 0.0, 0.0)
    timeline.close()
    events = json.loads(path.read_bytes())
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert names == {1: "a", 2: "b", 3: "c"}
    assert [e["tid"] for e in events if e["ph"] == "X"] == [1, 2, 1, 3, 2]
    assert all(e["pid"] == 0 for e in events)


@pytest.mark.timeout(30)
def test_the_file_is_a_json_array_after_every_event(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text("x" * 1000)                         # an older, longer trace is replaced
    timeline = Timeline(str(path))
    assert [e["ph"] for e in events_when(path, 1)] == ["M"]
    for count in range(1, 4):
        timeline.span("t", f"step{count}", 0.0, 1.0)
        events = events_when(path, 2 + count)
        assert [e["name"] for e in events if e["ph"] == "X"] == [
            f"step{i}" for i in range(1, count + 1)]
    timeline.close()
    assert path.read_bytes().endswith(b"}]")


@pytest.mark.timeout(60)
def test_a_timeline_never_closed_does_not_keep_the_process_alive(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    code = ("import sys; from hvdlite.core.timeline import Timeline; "
            "Timeline(sys.argv[1]).span('t', 'allreduce', 0.0, 1.0)")
    subprocess.run([sys.executable, "-c", code, str(path)], check=True, timeout=30,
                   cwd=Path(__file__).resolve().parents[2])
    assert json.loads(path.read_bytes())[0]["ph"] == "M"
