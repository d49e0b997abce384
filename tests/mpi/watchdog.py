"""What every rank was doing when a multi-rank test outlived its timeout.

pytest-timeout dumps the threads of the one rank whose timer fires first and ends
that rank; a CI log's tail then shows one main thread waiting, and not what the
other ranks were doing or what the engines held. Here each rank, shortly before
pytest-timeout would fire, dumps all its threads, then (a few seconds later, so
that the short lines of every rank come after the long dumps, at the log's end)
one line each: the test, where the main and engine threads are, and the
collectives its engine still has pending or in flight. Then it exits, failing the
job as the timeout would have. Test bookkeeping only: hvdlite never imports it.
"""
from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from typing import Any, Optional

# How long before pytest-timeout's own timer the dump starts (at most a tenth of the
# limit): a test that ends inside it passes no more, so it is short; the summary comes
# halfway between the two.
LEAD_S = 4.0


def timeout_of(item: Any) -> Optional[float]:
    """The pytest-timeout limit of ``item`` in seconds (its marker, else the ini's)."""
    marker = item.get_closest_marker("timeout")
    if marker is not None:
        value = marker.args[0] if marker.args else marker.kwargs.get("timeout")
    else:
        value = item.config.getini("timeout")
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        return None
    return seconds if seconds > 0 else None


def _where(frame: Any) -> str:
    """The innermost frame of a thread inside this repository, or its innermost one."""
    shown = frame
    while frame is not None:
        if "/hvdlite/" in frame.f_code.co_filename or "/tests/" in frame.f_code.co_filename:
            shown = frame
            break
        frame = frame.f_back
    if shown is None:
        return "?"
    return f"{_short(shown.f_code.co_filename)}:{shown.f_lineno} in {shown.f_code.co_name}"


def _short(path: str) -> str:
    for root in ("/hvdlite/", "/tests/"):
        if root in path:
            return root.strip("/") + "/" + path.split(root, 1)[1]
    return os.path.basename(path)


def _engine_state() -> str:
    from hvdlite.api.runtime import RUNTIME
    engine = RUNTIME.engine
    if engine is None:
        return "no engine"
    parts = []
    for state in engine.registry.members():
        names = sorted(state.pending)
        shown = ", ".join(names[:4]) + (f", ... ({len(names)})" if len(names) > 4 else "")
        parts.append(f"set {state.set_id} pending [{shown}]")
    in_flight = sum(len(names) for names in engine._in_flight.values())
    parts.append(f"in flight {in_flight}, parked {engine.handles.waiting}, "
                 f"lanes busy {engine.lanes.busy}, dead {engine.dead!r}")
    return "; ".join(parts)


def summary(rank: int, nodeid: str) -> str:
    frames = sys._current_frames()
    threads = {t.ident: t.name for t in threading.enumerate()}
    main = frames.get(threading.main_thread().ident)
    engine = next((frames[i] for i, n in threads.items() if n == "hvdlite-engine" and i in frames),
                  None)
    try:
        state = _engine_state()
    except Exception as exc:     # a summary must never hide the dump above it
        state = f"engine state unreadable: {exc!r}"
    return (f"[watchdog] rank {rank} stuck in {nodeid}: main at {_where(main)}; "
            f"engine at {_where(engine) if engine else 'no engine thread'}; {state}")


class Watchdog:
    """Armed around one test on one rank; fires once if the test is still running."""

    def __init__(self, item: Any, rank: int, timeout_s: float) -> None:
        self._rank, self._nodeid = rank, item.nodeid
        self._capture = item.config.pluginmanager.getplugin("capturemanager")
        self._done = threading.Event()
        lead = min(LEAD_S, timeout_s / 10)
        self._thread = threading.Thread(target=self._watch, args=(timeout_s - lead, lead / 2),
                                        name="tests-watchdog", daemon=True)
        self._thread.start()

    def cancel(self) -> None:
        self._done.set()

    def _watch(self, after_s: float, summary_after_s: float) -> None:
        if self._done.wait(after_s):
            return
        if self._capture is not None:     # the test's output is captured: write past it
            self._capture.suspend_global_capture(in_=True)
        sys.stderr.write(f"\n[watchdog] rank {self._rank}: {self._nodeid} still running "
                         f"after {after_s:.0f} s; its threads:\n")
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        time.sleep(summary_after_s)     # every rank's dump first, then the short lines
        sys.stderr.write(summary(self._rank, self._nodeid) + "\n")
        sys.stderr.flush()
        os._exit(1)
