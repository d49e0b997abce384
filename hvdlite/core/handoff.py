"""Tensors handed to torch's Gloo threads, watched until Gloo has let go of them.

A Gloo worker thread drops its reference to a finished operation only after marking it
complete, so the Python side may already have moved on. While any C++ object holds a
tensor made in Python, torch holds a reference to the tensor's Python object too, and
the last C++ holder gives it back, taking the GIL. When that is Gloo's thread and the
interpreter is finalizing by then, Python ends the thread (``pthread_exit``), and the
unwinding through torch's ``noexcept`` frames aborts the process after a job that did
everything right: "terminate called without an active exception", exit -6. A core dump
of that abort shows the worker thread in ``~AsyncBroadcastWork`` (or another Work) ->
``TensorImpl::decref_pyobject`` -> ``take_gil`` -> ``PyThread_exit_thread``, and the
main thread in ``Py_FinalizeEx``.

So hvdlite keeps no reference of its own to a tensor once its operation is complete,
only a weak one here: the Python object dies when the last C++ holder gives it back.
At exit (``transport_torch``'s atexit hook, before the interpreter finalizes) it waits,
with the GIL released, until every tensor it handed to Gloo has died that way.
"""
from __future__ import annotations

import threading
import time
import weakref
from typing import Any, Iterable

# Past _MOST, the oldest are forgotten unchecked, so that a tensor something else keeps
# alive cannot grow the list without bound.
_MOST = 4096
_PAUSE_S = 0.001


class Handoff:
    """Weak references to the tensors of completed operations; any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watched: list[weakref.ref[Any]] = []

    def watch(self, tensors: Iterable[Any]) -> None:
        """Watch ``tensors``, of an operation Gloo has completed, which the caller then
        lets go of: from here on only Gloo may hold them."""
        with self._lock:
            self._sweep()
            self._watched.extend(weakref.ref(tensor) for tensor in tensors)

    def _sweep(self) -> None:
        self._watched = [ref for ref in self._watched if ref() is not None][-_MOST:]

    def alive(self) -> int:
        """How many of the tensors watched something still holds."""
        with self._lock:
            self._sweep()
            return len(self._watched)

    def await_released(self, timeout_s: float) -> bool:
        """Wait, sleeping (the GIL released, so that Gloo's threads can take it), until
        every tensor watched has died; False if some are alive after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while self.alive():
            if time.monotonic() >= deadline:
                return False
            time.sleep(_PAUSE_S)
        return True


HANDOFF = Handoff()
