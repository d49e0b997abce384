"""Handles: what an ``*_async`` call returns and ``synchronize`` waits on.

Slots are plain objects, not one Event each: creating an Event per tensor and
taking its lock on completion cost more than the collective for small tensors.
The engine marks a batch of slots done and notifies once per batch. A thread
that has to block parks on a lock of its own, which the engine's notify
releases: one futex wake-up. A Condition (or an Event, built on one) costs a
second lock hand-off as the woken thread takes the condition's lock back: on two
cores at np=2, a 4-byte allreduce handed to a thread and back took 80 us through
Events and 43-58 us through bare locks.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Optional

from hvdlite.errors import HvdliteError


Finish = Optional[Callable[[Any], Any]]


class _Slot:
    __slots__ = ("done", "result", "error", "finish", "parker")

    def __init__(self, finish: Finish) -> None:
        self.done = False
        self.result: Any = None
        self.error: Optional[BaseException] = None
        self.finish = finish   # result -> what synchronize returns (a binding's tensor)
        self.parker: Any = None   # a held lock its blocked waiter sleeps on


class HandleTable:
    """Thread-safe map from integer handles to pending results."""

    def __init__(self) -> None:
        self._slots: dict[int, _Slot] = {}
        self._parked: dict[int, _Slot] = {}   # handles a user thread is blocked on
        self._next = 0

    @property
    def waiting(self) -> int:
        """User threads blocked in wait(); tells the engine to spin."""
        return len(self._parked)

    @property
    def created(self) -> int:
        """Handles created so far: a count that moves with every submission."""
        return self._next

    def parked(self) -> set[int]:
        """The handles user threads are blocked on now."""
        return set(self._parked)

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
        """Wake the threads blocked on handles that are done. Each parked slot is
        popped before its lock is released, so a lock is released once only."""
        for handle, slot in list(self._parked.items()):   # one C call: a snapshot
            if slot.done and self._parked.pop(handle, None) is not None:
                slot.parker.release()

    def fail_all(self, error: BaseException) -> None:
        for handle in list(self._slots):
            self.fail(handle, error)
        self.notify()

    def poll(self, handle: int) -> bool:
        return self._slot(handle).done

    def wait(self, handle: int) -> Any:
        """Block until done, forget the handle, return its result or raise its error."""
        try:
            slot = self._slots[handle]
        except (KeyError, TypeError):
            slot = self._slot(handle)     # raises the explanation
        if not slot.done:
            self._park(handle, slot)
        self._slots.pop(handle, None)
        if slot.error is not None:
            raise slot.error
        return slot.result if slot.finish is None else slot.finish(slot.result)

    def _park(self, handle: int, slot: _Slot) -> None:
        """Sleep until notify() sees the slot done. Registered before done is checked
        again: a completion racing with this is either seen by that check or followed
        by a notify() that finds the slot parked (the engine notifies after marking)."""
        parker = threading.Lock()
        parker.acquire()
        slot.parker = parker
        self._parked[handle] = slot
        try:
            if not slot.done:
                parker.acquire()
        finally:
            self._parked.pop(handle, None)
