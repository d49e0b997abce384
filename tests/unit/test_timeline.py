"""The Chrome-trace timeline, without MPI: Horovod's layout and event names (a trace
"process" per tensor, NEGOTIATE_<OP>, <OP> holding its activities, CYCLE_START), the
times, and a file that is a valid JSON array after every event."""
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

from hvdlite.negotiation.requests import Descriptor, Kind, Request
from hvdlite.recording import timeline as timeline_module
from hvdlite.recording.timeline import Timeline, row_label

_handles = iter(range(1, 1 << 20))


def request(name: str, kind: Kind = Kind.ALLREDUCE, set_id: int = 0,
            submitted: float = 0.0) -> Request:
    made = Request(Descriptor(name, kind, "float32", (2, 3)), set_id)
    made.handle, made.submitted_at = next(_handles), submitted
    return made


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
    """Timelines made in the test start at monotonic time 1000, wall time 5000 s."""
    monkeypatch.setattr(timeline_module, "time",
                        SimpleNamespace(monotonic=lambda: 1000.0, time=lambda: 5000.0))
    return 1000.0


@pytest.mark.timeout(30)
def test_an_op_is_negotiated_then_runs_its_activities_on_its_own_row(
        tmp_path: Path, origin: float) -> None:
    path = tmp_path / "t.json"
    mask = os.umask(0o022)
    try:
        timeline = Timeline(str(path), rank=3)
    finally:
        os.umask(mask)
    grad = request("grad", submitted=origin + 1.0)
    timeline.agreed(grad, origin + 2.0)
    timeline.span(grad, "QUEUE", origin + 2.0, origin + 2.5, {"bytes": 16})
    timeline.span(grad, "MPI_ALLREDUCE", origin + 2.5 + 1.234567e-6, origin + 2.0)  # clock step
    timeline.done(grad, origin + 3.0)
    timeline.close()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644   # a new file: rw-r--r--
    events = json.loads(path.read_bytes())
    assert events == [
        {"name": "process_name", "ph": "M", "pid": 0, "tid": 0,
         "args": {"name": "hvdlite rank 3", "start_time_since_epoch_in_micros": 5_000_000_000}},
        {"name": "process_name", "ph": "M", "pid": 1, "tid": 0,
         "args": {"name": "allreduce.grad"}},
        {"name": "process_sort_index", "ph": "M", "pid": 1, "tid": 0, "args": {"sort_index": 1}},
        {"name": "NEGOTIATE_ALLREDUCE", "ph": "X", "pid": 1, "tid": 0, "ts": 1e6, "dur": 1e6},
        {"name": "ALLREDUCE", "ph": "B", "pid": 1, "tid": 0, "ts": 2e6},
        {"name": "QUEUE", "ph": "X", "pid": 1, "tid": 0, "ts": 2e6, "dur": 5e5,
         "args": {"bytes": 16}},
        {"name": "MPI_ALLREDUCE", "ph": "X", "pid": 1, "tid": 0, "ts": 2500001.235,
         "dur": 0.0},
        {"ph": "E", "pid": 1, "tid": 0, "ts": 3e6,
         "args": {"dtype": "float32", "shape": "[2, 3]"}}]


def test_rows_are_named_as_horovods_torch_names_tensors() -> None:
    assert row_label(("grad", "allreduce", 0)) == "allreduce.grad"
    assert row_label(("allreduce.noname.3", "allreduce", 0)) == "allreduce.noname.3"
    assert row_label(("w", "broadcast", 2)) == "broadcast.w [process set 2]"


@pytest.mark.timeout(30)
def test_each_row_is_a_process_named_once(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    timeline = Timeline(str(path))
    ops = {"a": request("a"), "b": request("b", Kind.ALLGATHER), "c": request("c", set_id=1)}
    for name in ("a", "b", "a", "c", "b"):
        timeline.span(ops[name], "QUEUE", 0.0, 0.0)
    timeline.close()
    events = json.loads(path.read_bytes())
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {0: "hvdlite rank 0", 1: "allreduce.a", 2: "allgather.b",
                     3: "allreduce.c [process set 1]"}
    assert [e["pid"] for e in events if e["ph"] == "X"] == [1, 2, 1, 3, 2]


@pytest.mark.timeout(30)
def test_a_failed_agreement_or_an_op_it_did_not_open_gets_no_op_span(tmp_path: Path) -> None:
    """A refused op is negotiated but never runs; an op agreed before the timeline was
    started completes without a begin on it, so it gets no unmatched end either."""
    path = tmp_path / "t.json"
    timeline = Timeline(str(path))
    refused, earlier = request("refused"), request("earlier")
    timeline.agreed(refused, 1.0, runs=False)
    timeline.done(refused, 2.0)
    timeline.done(earlier, 2.0)
    timeline.close()
    phases = [(e["ph"], e.get("name")) for e in json.loads(path.read_bytes()) if e["ph"] != "M"]
    assert phases == [("X", "NEGOTIATE_ALLREDUCE")]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mark", [True, False])
def test_cycles_are_marked_only_when_asked(tmp_path: Path, mark: bool) -> None:
    path = tmp_path / "t.json"
    timeline = Timeline(str(path), mark_cycles=mark)
    for _ in range(3):
        timeline.cycle_start()
    timeline.close()
    marks = [e for e in json.loads(path.read_bytes()) if e["name"] == "CYCLE_START"]
    assert len(marks) == (3 if mark else 0)
    assert all(e["ph"] == "i" and e["s"] == "g" for e in marks)


@pytest.mark.timeout(30)
def test_the_file_is_a_json_array_after_every_event(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text("x" * 1000)                         # an older, longer trace is replaced
    timeline = Timeline(str(path))
    assert [e["ph"] for e in events_when(path, 1)] == ["M"]
    op = request("t")
    for count in range(1, 4):
        timeline.span(op, f"STEP{count}", 0.0, 1.0)
        events = events_when(path, 3 + count)
        assert [e["name"] for e in events if e["ph"] == "X"] == [
            f"STEP{i}" for i in range(1, count + 1)]
    timeline.close()
    assert path.read_bytes().endswith(b"}]")


@pytest.mark.timeout(60)
def test_a_timeline_never_closed_does_not_keep_the_process_alive(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    code = ("import sys; from hvdlite.recording.timeline import Timeline; "
            "Timeline(sys.argv[1], mark_cycles=True).cycle_start()")
    subprocess.run([sys.executable, "-c", code, str(path)], check=True, timeout=30,
                   cwd=Path(__file__).resolve().parents[2])
    assert json.loads(path.read_bytes())[0]["ph"] == "M"


@pytest.mark.timeout(30)
def test_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    """hvd.start_timeline(path) on rank 0: opening a FIFO for writing would block until
    something reads it (the init() check refuses it too, before any Timeline)."""
    import threading
    from hvdlite.errors import OutputPathError
    fifo = tmp_path / "trace.fifo"
    os.mkfifo(fifo)
    outcome: list[BaseException] = []

    def start() -> None:
        try:
            Timeline(str(fifo)).close()
        except BaseException as exc:            # the outcome, whatever it is
            outcome.append(exc)

    opener = threading.Thread(target=start, daemon=True)
    opener.start()
    opener.join(5)
    if opener.is_alive():                       # blocked in open(): let it through
        os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
        opener.join(5)
    assert not opener.is_alive() and len(outcome) == 1, outcome
    assert isinstance(outcome[0], OutputPathError), outcome
    assert f"{fifo} is a FIFO, not a regular file" in str(outcome[0])
