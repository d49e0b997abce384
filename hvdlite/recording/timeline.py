"""Chrome-trace timeline (chrome://tracing, Perfetto), written by rank 0, in the
layout and with the names of Horovod's timeline, so tools written for Horovod's
traces read it:

* one row per tensor: a trace "process" named ``<op>.<name>`` (``allreduce.grad``;
  unnamed ops are already ``allreduce.noname.N``), with `` [process set N]`` added
  off the global set;
* ``NEGOTIATE_<OP>`` (``NEGOTIATE_ALLREDUCE``...): from submission to agreement;
* ``<OP>`` (``ALLREDUCE``...): from agreement to completion, holding its activities:
  ``QUEUE``, ``MEMCPY_IN_FUSION_BUFFER``, ``<BACKEND>_<OP>`` (``MPI_ALLREDUCE``,
  ``RING_ALLREDUCE``...), ``MEMCPY_OUT_FUSION_BUFFER``;
* with ``mark_cycles``, a ``CYCLE_START`` instant at each engine cycle.

A writer thread appends each event just before the closing bracket, in one write,
so the file is a valid JSON array after every write and a crash leaves a readable
trace (a read racing with a write may see it half done). The engine only enqueues
tuples; it never waits on the disk. An op's events are queued before its handle
completes, and reach the file within milliseconds.
"""
from __future__ import annotations

import json
import os
import queue
import threading
import time
from typing import Any, Optional

from hvdlite.recording.outputs import open_for_writing

_STOP = object()
# Horovod's value of HOROVOD_TIMELINE that enables start_timeline() without a file yet.
DYNAMIC = "DYNAMIC"
Row = tuple[str, str, int]    # (name, op, process set id): one trace row


def _row(request: Any) -> Row:
    return (request.desc.name, request.desc.kind.value, request.process_set_id)


def row_label(row: Row) -> str:
    """The row's name, as Horovod's torch binding names tensors: ``<op>.<name>``."""
    name, op, set_id = row
    label = name if name.startswith(op + ".") else f"{op}.{name}"
    return label if set_id == 0 else f"{label} [process set {set_id}]"


class Timeline:
    def __init__(self, path: str, rank: int = 0, mark_cycles: bool = False) -> None:
        self.path = path
        self.mark_cycles = mark_cycles
        self._origin = time.monotonic()
        self._queue: "queue.SimpleQueue[object]" = queue.SimpleQueue()
        self._open: set[int] = set()   # handles whose op span is open (engine thread only)
        self._fd = open_for_writing(path)     # a FIFO would block here: refused
        os.write(self._fd, b"[]")
        self._end = 1  # offset of the closing bracket
        self._first = True
        self._pids: dict[Row, int] = {}
        self._thread = threading.Thread(target=self._drain, name="hvdlite-timeline", daemon=True)
        self._thread.start()
        since_epoch = time.time() - (time.monotonic() - self._origin)
        self._emit({"name": "process_name", "ph": "M", "pid": 0, "tid": 0,
                    "args": {"name": f"hvdlite rank {rank}",
                             "start_time_since_epoch_in_micros": int(since_epoch * 1e6)}})

    # -- engine thread: each call enqueues one tuple -----------------------------------
    def agreed(self, request: Any, at: float, runs: bool = True) -> None:
        """``request`` was agreed by every rank ``at`` (time.monotonic()): its
        negotiation span, and unless it failed (``runs`` False) its op span opens."""
        row = _row(request)
        op = row[1].upper()
        self._queue.put(("X", row, "NEGOTIATE_" + op, request.submitted_at, at, None))
        if runs:
            self._open.add(request.handle)
            self._queue.put(("B", row, op, at))

    def span(self, request: Any, activity: str, start: float, end: float,
             args: Optional[dict] = None) -> None:
        """An activity inside the request's op span; times are time.monotonic()."""
        self._queue.put(("X", _row(request), activity, start, end, args))

    def done(self, request: Any, at: float) -> None:
        """The request completed or failed: its op span closes, if this timeline
        opened it (one started meanwhile did not)."""
        if request.handle in self._open:
            self._open.discard(request.handle)
            desc = request.desc
            args = {"dtype": desc.dtype, "shape": str(list(desc.shape))} if desc.dtype else None
            self._queue.put(("E", _row(request), at, args))

    def cycle_start(self) -> None:
        if self.mark_cycles:
            self._queue.put(("i", time.monotonic()))

    def close(self) -> None:
        self._queue.put(_STOP)
        self._thread.join(timeout=5)
        os.close(self._fd)

    # -- writer thread --------------------------------------------------------------------
    def _drain(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            self._emit(self._event(item))    # type: ignore[arg-type]

    def _event(self, item: tuple) -> dict:
        phase = item[0]
        if phase == "i":
            return {"name": "CYCLE_START", "ph": "i", "s": "g", "pid": 0, "tid": 0,
                    "ts": self._micros(item[1])}
        pid = self._pid(item[1])
        if phase == "X":
            _, _, name, start, end, args = item
            event = {"name": name, "ph": "X", "pid": pid, "tid": 0, "ts": self._micros(start),
                     "dur": round(max(0.0, end - start) * 1e6, 3)}
        elif phase == "B":
            event = {"name": item[2], "ph": "B", "pid": pid, "tid": 0, "ts": self._micros(item[3])}
            args = None
        else:
            event = {"ph": "E", "pid": pid, "tid": 0, "ts": self._micros(item[2])}
            args = item[3]
        if args:
            event["args"] = args
        return event

    def _micros(self, at: float) -> float:
        return round((at - self._origin) * 1e6, 3)

    def _pid(self, row: Row) -> int:
        """Each row is a trace "process", as in Horovod's timeline; pid 0 is the rank."""
        pid = self._pids.get(row)
        if pid is None:
            pid = self._pids[row] = len(self._pids) + 1
            self._emit({"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                        "args": {"name": row_label(row)}})
            self._emit({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0,
                        "args": {"sort_index": pid}})
        return pid

    def _emit(self, event: dict) -> None:
        text = ("" if self._first else ",") + "\n" + json.dumps(event) + "]"
        data = text.encode()
        os.pwrite(self._fd, data, self._end)
        self._end += len(data) - 1
        self._first = False
