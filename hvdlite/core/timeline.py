"""Chrome-trace timeline (chrome://tracing, Perfetto), written by rank 0.

A writer thread appends each event just before the closing bracket, in one
write, so the file is a valid JSON array after every write and a crash leaves a
readable trace (a read racing with a write may see it half done). The engine
only enqueues tuples; it never waits on the disk.
"""
from __future__ import annotations

import json
import os
import queue
import threading
import time
from typing import Optional

_STOP = object()


class Timeline:
    def __init__(self, path: str, rank: int = 0) -> None:
        self.path = path
        self._origin = time.monotonic()
        self._queue: "queue.SimpleQueue[object]" = queue.SimpleQueue()
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(self._fd, b"[]")
        self._end = 1  # offset of the closing bracket
        self._first = True
        self._tids: dict[str, int] = {}
        self._rank = rank
        self._thread = threading.Thread(target=self._drain, name="hvdlite-timeline", daemon=True)
        self._thread.start()
        self._emit({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                    "args": {"name": f"hvdlite rank {rank}"}})

    def span(self, tensor: str, phase: str, start: float, end: float,
             args: Optional[dict] = None) -> None:
        """A complete event for ``tensor``; times are time.monotonic() seconds."""
        self._queue.put((tensor, phase, start, end, args))

    def close(self) -> None:
        self._queue.put(_STOP)
        self._thread.join(timeout=5)
        os.close(self._fd)

    def _drain(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            tensor, phase, start, end, args = item  # type: ignore[misc]
            self._emit({"name": phase, "ph": "X", "pid": self._rank, "tid": self._tid(tensor),
                        "ts": round((start - self._origin) * 1e6, 3),
                        "dur": round(max(0.0, end - start) * 1e6, 3),
                        "args": dict(args or {}, tensor=tensor)})

    def _tid(self, tensor: str) -> int:
        tid = self._tids.get(tensor)
        if tid is None:
            tid = self._tids[tensor] = len(self._tids) + 1
            self._emit({"name": "thread_name", "ph": "M", "pid": self._rank, "tid": tid,
                        "args": {"name": tensor}})
        return tid

    def _emit(self, event: dict) -> None:
        text = ("" if self._first else ",") + "\n" + json.dumps(event) + "]"
        data = text.encode()
        os.pwrite(self._fd, data, self._end)
        self._end += len(data) - 1
        self._first = False
