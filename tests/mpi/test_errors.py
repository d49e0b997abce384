"""Misuse becomes a clear error on every rank, and the engine keeps working."""
from __future__ import annotations

import json
import logging
import time
from typing import Callable

import numpy as np
import pytest

import hvdlite as hvd
from tests.mpi.outcomes import channel, under_torchrun
from hvdlite.api.control import reconfigure


def _next_op_works(tag: str) -> None:
    result = hvd.allreduce(np.ones(3), op=hvd.Sum, name=f"recover.{tag}")
    np.testing.assert_array_equal(result, np.full(3, float(hvd.size())))


def _last(rank_value: object, other: object) -> object:
    return rank_value if hvd.rank() == hvd.size() - 1 else other


MISMATCHES: dict[str, tuple[Callable[[str], object], str]] = {
    "shape": (lambda n: hvd.allreduce(np.ones(_last(4, 3)), name=n), "shape"),
    "dtype": (lambda n: hvd.allreduce(np.ones(3, dtype=_last(np.float32, np.float64)), name=n),
              "dtype"),
    "op": (lambda n: hvd.allreduce(np.ones(3), op=_last(hvd.Max, hvd.Sum), name=n), "op"),
    "root": (lambda n: hvd.broadcast(np.ones(3), root_rank=_last(1, 0), name=n), "root"),
    "prescale": (lambda n: hvd.allreduce(np.ones(3), prescale_factor=_last(2.0, 1.0), name=n),
                 "prescale"),
    "postscale": (lambda n: hvd.allreduce(np.ones(3), postscale_factor=_last(2.0, 1.0), name=n),
                  "postscale"),
    "collective": (lambda n: (hvd.allgather if hvd.rank() == hvd.size() - 1 else hvd.allreduce)(
        np.ones(3), name=n), "collective"),
    "gather_trailing": (lambda n: hvd.allgather(np.ones((2, _last(5, 4))), name=n),
                        "trailing_shape"),
    "reducescatter_op": (lambda n: hvd.reducescatter(np.ones(4), op=_last(hvd.Sum, hvd.Average),
                                                     name=n), "op"),
}


@pytest.mark.parametrize("case", sorted(MISMATCHES))
def test_mismatch_raises_on_every_rank(case: str) -> None:
    call, field = MISMATCHES[case]
    if case == "root" and hvd.size() < 2:
        pytest.skip("needs two ranks")
    name = f"mismatch.{case}"
    with pytest.raises(hvd.MismatchError) as info:
        call(name)
    message = str(info.value)
    assert f"'{name}'" in message and field in message
    assert f"ranks [{hvd.size() - 1}]" in message        # names the odd rank out
    assert isinstance(info.value, RuntimeError)           # what Horovod scripts catch
    _next_op_works(case)


def test_mismatch_after_the_name_was_cached() -> None:
    """A name agreed many times (cached fast path) that then changes shape on one
    rank must still be caught, not silently reduced with the cached shape."""
    for _ in range(5):
        hvd.allreduce(np.ones(6), name="cached.then.changed")
    with pytest.raises(hvd.MismatchError, match="shape"):
        hvd.allreduce(np.ones(_last(7, 6)), name="cached.then.changed")
    _next_op_works("cached")
    np.testing.assert_array_equal(hvd.allreduce(np.ones(6), op=hvd.Sum, name="cached.then.changed"),
                                  np.full(6, float(hvd.size())))


def test_duplicate_name_in_flight_is_a_value_error() -> None:
    handle = hvd.allreduce_async(np.ones(2), name="dup")
    with pytest.raises(ValueError, match="'dup' is already in flight"):
        hvd.allreduce_async(np.ones(2), name="dup")
    hvd.synchronize(handle)
    _next_op_works("dup")


def test_local_argument_errors() -> None:
    with pytest.raises(TypeError, match="bool"):
        hvd.allreduce(np.ones(2, dtype=bool), name="bad.bool")
    with pytest.raises(TypeError, match="complex"):
        hvd.allreduce(np.ones(2, dtype=np.complex64), op=hvd.Max, name="bad.complex")
    with pytest.raises(ValueError, match="root_rank"):
        hvd.broadcast(np.ones(2), root_rank=hvd.size(), name="bad.root")
    with pytest.raises(ValueError, match="splits"):
        hvd.alltoall(np.ones(3), splits=[3] + [1] * (hvd.size() - 1), name="bad.splits")
    with pytest.raises(ValueError, match="unknown reduction op"):
        hvd.allreduce(np.ones(2), op=42, name="bad.op")
    with pytest.raises(TypeError, match="unsupported dtype"):
        hvd.allreduce(np.array(["a"]), name="bad.str")
    with pytest.raises(hvd.HvdliteError, match="unknown"):
        hvd.synchronize(123456789)
    _next_op_works("local")


def test_join_with_non_allreduce_is_an_error_everywhere() -> None:
    if hvd.size() < 2:
        pytest.skip("needs two ranks")
    error = None
    if hvd.rank() != 0:
        try:
            hvd.allgather(np.ones(1), name="gather.during.join")
        except hvd.HvdliteError as exc:     # asserted after join(): no rank is left in it
            error = exc
    last = hvd.join()
    _next_op_works("join")
    assert last in range(1, hvd.size())     # rank 0 joined first; the last is another
    if hvd.rank() != 0:
        assert isinstance(error, hvd.JoinError) and "join" in str(error), repr(error)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_stall_warning_names_tensor_and_missing_ranks() -> None:
    if hvd.size() < 2:
        pytest.skip("needs two ranks")
    reconfigure(stall_check_time=0.5)    # negotiated: every rank switches at the same point
    records = _Records()
    logging.getLogger("hvdlite").addHandler(records)
    try:
        # Every rank but 0 is late with this tensor until rank 0 has logged its stall
        # (or given up after a minute: the check below then fails).
        if hvd.rank() == 0:
            handle = hvd.allreduce_async(np.ones(2), name="stall.probe")
            deadline = time.monotonic() + 60
            while not any("'stall.probe'" in m for m in records.messages) \
                    and time.monotonic() < deadline:
                time.sleep(0.01)
            channel().idle_until_all_arrive()
            hvd.synchronize(handle)
        else:
            channel().idle_until_all_arrive()
            hvd.allreduce(np.ones(2), name="stall.probe")
    finally:
        logging.getLogger("hvdlite").removeHandler(records)
        reconfigure(stall_check_time=60.0)
    if hvd.rank() == 0:
        expected = f"missing ranks: {list(range(1, hvd.size()))}"
        matching = [m for m in records.messages if "'stall.probe'" in m and expected in m]
        assert matching, records.messages


def test_timeline_is_valid_json_with_spans(tmp_path_factory: pytest.TempPathFactory) -> None:
    path = str(tmp_path_factory.mktemp("timeline") / "timeline.json")
    hvd.start_timeline(path)
    for step in range(3):
        hvd.grouped_allreduce([np.ones(100), np.ones(50)], op=hvd.Sum, name=f"tl.{step}")
        hvd.allgather(np.ones(2), name=f"tl.gather.{step}")
    if hvd.rank() == 0:
        time.sleep(0.2)
        json.loads(open(path).read())        # valid while still being written
    hvd.stop_timeline()
    if hvd.rank() == 0:
        events = json.load(open(path))
        phases = {e["name"] for e in events if e.get("ph") in ("X", "B")}
        # The backend's part: MPI's, or under torchrun the torch transport's own.
        wire = "TRANSPORT" if under_torchrun() else "MPI"
        assert {"NEGOTIATE_ALLREDUCE", "ALLREDUCE", "QUEUE", "MEMCPY_IN_FUSION_BUFFER",
                f"{wire}_ALLREDUCE", "MEMCPY_OUT_FUSION_BUFFER", "NEGOTIATE_ALLGATHER",
                "ALLGATHER", f"{wire}_ALLGATHER"} <= phases
        rows = {e["args"]["name"] for e in events if e.get("name") == "process_name"}
        assert "allreduce.tl.0.0" in rows and "allgather.tl.gather.2" in rows, rows
