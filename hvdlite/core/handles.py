"""Handles: what an ``*_async`` call returns and ``synchronize`` waits on."""
from __future__ import annotations

import threading
from typing import Any, Optional

from hvdlite.errors import HvdliteError


class _Slot:
    __slots__ = ("done", "result", "error", "name")

    def __init__(self, name: str) -> None:
        self.done = threading.Event()
        self.result: Any = None
        self.error: Optional[BaseException] = None
        self.name = name


class HandleTable:
    """Thread-safe map from integer handles to pending results."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._slots: dict[int, _Slot] = {}
        self._next = 0

    def create(self, name: str) -> int:
        with self._lock:
            handle = self._next
            self._next += 1
            self._slots[handle] = _Slot(name)
            return handle

    def _slot(self, handle: int) -> _Slot:
        try:
            return self._slots[handle]
        except KeyError:
            raise HvdliteError(
                f"handle {handle!r} is unknown: it was never returned by an *_async call "
                "or has already been synchronized") from None

    def complete(self, handle: int, result: Any) -> None:
        slot = self._slots.get(handle)
        if slot is not None:
            slot.result = result
            slot.done.set()

    def fail(self, handle: int, error: BaseException) -> None:
        slot = self._slots.get(handle)
        if slot is not None and not slot.done.is_set():
            slot.error = error
            slot.done.set()

    def fail_all(self, error: BaseException) -> None:
        with self._lock:
            handles = list(self._slots)
        for handle in handles:
            self.fail(handle, error)

    def poll(self, handle: int) -> bool:
        return self._slot(handle).done.is_set()

    def wait(self, handle: int) -> Any:
        """Block until done, forget the handle, return its result or raise its error."""
        slot = self._slot(handle)
        slot.done.wait()
        with self._lock:
            self._slots.pop(handle, None)
        if slot.error is not None:
            raise slot.error
        return slot.result
