"""Handles: what an ``*_async`` call returns and ``synchronize`` waits on.

Slots are plain objects behind one Condition rather than one Event each:
creating an Event per tensor and taking its lock on completion cost more than
the collective for small tensors. The engine marks a batch of slots done and
notifies once per batch.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Optional

from hvdlite.errors import HvdliteError


Finish = Optional[Callable[[Any], Any]]


class _Slot:
    __slots__ = ("done", "result", "error", "finish")

    def __init__(self, finish: Finish) -> None:
        self.done = False
        self.result: Any = None
        self.error: Optional[BaseException] = None
        self.finish = finish   # result -> what synchronize returns (a binding's tensor)


class HandleTable:
    """Thread-safe map from integer handles to pending results."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._slots: dict[int, _Slot] = {}
        self._next = 0
        self.waiting = 0   # user threads blocked in wait(); tells the engine to spin

    def create(self, finish: Finish = None) -> int:
        """A new pending handle. ``finish`` runs on the waiting thread and turns the
        engine's result into the object to return, so no binding keeps its own map
        from handles to outputs."""
        # Called with the engine's submit lock held, so the counter needs no lock here;
        # dict assignment is atomic under the GIL.
        handle = self._next
        self._next += 1
        self._slots[handle] = _Slot(finish)
        return handle

    def _slot(self, handle: Any) -> _Slot:
        try:
            return self._slots[handle]
        except (KeyError, TypeError):
            raise HvdliteError(
                f"handle {handle!r} is unknown: it was never returned by an *_async call "
                "or has already been synchronized") from None

    def complete(self, handle: int, result: Any) -> None:
        """Mark done without waking waiters; call notify() after a batch."""
        slot = self._slots.get(handle)
        if slot is not None and not slot.done:
            slot.result = result
            slot.done = True

    def fail(self, handle: int, error: BaseException) -> None:
        slot = self._slots.get(handle)
        if slot is not None and not slot.done:
            slot.error = error
            slot.done = True

    def notify(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def fail_all(self, error: BaseException) -> None:
        for handle in list(self._slots):
            self.fail(handle, error)
        self.notify()

    def poll(self, handle: int) -> bool:
        return self._slot(handle).done

    def wait(self, handle: int) -> Any:
        """Block until done, forget the handle, return its result or raise its error."""
        slot = self._slot(handle)
        if not slot.done:
            with self._cond:
                self.waiting += 1
                try:
                    while not slot.done:
                        self._cond.wait()
                finally:
                    self.waiting -= 1
        self._slots.pop(handle, None)
        if slot.error is not None:
            raise slot.error
        return slot.result if slot.finish is None else slot.finish(slot.result)
