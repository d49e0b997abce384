"""A timeline started while hvdlite runs, read as Horovod's tools read one: a row per
tensor named <op>.<name>, NEGOTIATE_<OP>, <OP>, the backend's <BACKEND>_<OP> inside,
CYCLE_START with mark_cycles; written by rank 0 only, while the job runs."""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

import hvdlite as hvd
from tests.mpi.outcomes import under_torchrun

pytestmark = pytest.mark.timeout(60)


def _events_once(path: Path, names: set[str], prefix: str = "") -> list[dict]:
    """The trace once ``names`` are all in it and, given ``prefix``, a name starting with
    it (the writer is a thread that may lag the last op; within 30 s on a busy machine)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            events = json.loads(path.read_bytes())
        except (json.JSONDecodeError, FileNotFoundError):   # a read racing a write
            events = []
        seen = _names(events)
        done = names <= seen and (not prefix or any(n.startswith(prefix) for n in seen))
        if done or time.monotonic() > deadline:
            return events
        time.sleep(0.01)


def _names(events: list[dict]) -> set[str]:
    rows = {e["args"]["name"] for e in events if e.get("name") == "process_name"}
    return rows | {e["name"] for e in events if "name" in e}


@pytest.mark.parametrize("mark_cycles", [True, False])
def test_a_started_timeline_names_events_as_horovod(tmp_path: Path, mark_cycles: bool) -> None:
    path = tmp_path / "trace.json"
    hvd.start_timeline(str(path), mark_cycles=mark_cycles)
    try:
        hvd.allreduce(np.ones(3), name=f"tl.{mark_cycles}")
        hvd.broadcast(np.ones(2), root_rank=0, name=f"tl.bcast.{mark_cycles}")
        hvd.allreduce(np.ones(1))
        wire = "TRANSPORT" if under_torchrun() else "MPI"    # the backend's part
        expected = {f"allreduce.tl.{mark_cycles}", "NEGOTIATE_ALLREDUCE", "ALLREDUCE",
                    f"{wire}_ALLREDUCE", f"broadcast.tl.bcast.{mark_cycles}",
                    "NEGOTIATE_BROADCAST", "BROADCAST", f"{wire}_BROADCAST"}
        if hvd.rank() != 0:
            assert not path.exists()           # rank 0 writes the job's one timeline
            return
        events = _events_once(path, expected | ({"CYCLE_START"} if mark_cycles else set()),
                              prefix="allreduce.noname.")
        names = _names(events)
        assert expected <= names, sorted(names)
        assert any(n.startswith("allreduce.noname.") for n in names), sorted(names)
        assert ("CYCLE_START" in names) == mark_cycles
    finally:
        hvd.stop_timeline()
