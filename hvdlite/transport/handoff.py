"""Tensors handed to torch's process groups, held until torch's threads have wholly let go
of them: the torch transport's Gloo groups (transport/torch_transport.py), and the device
groups of torch_nccl.py (Gloo's in the CPU stand-in; NCCL's on GPUs, a precaution there:
not seen). What follows is told of Gloo, where it was seen.

A Gloo worker thread drops its reference to a finished operation only after marking it
complete, so the Python side may already have moved on. While any C++ object holds a
tensor made in Python, torch holds a reference to the tensor's Python object too, and
the last C++ holder gives it back, taking the GIL. When that is Gloo's thread and the
interpreter is finalizing by then, Python ends the thread (``pthread_exit``), and the
unwinding through torch's ``noexcept`` frames aborts the process after a job that did
everything right: "terminate called without an active exception", exit -6. Core dumps
of that abort show the worker thread in ``~AsyncBroadcastWork`` (or another Work) ->
``TensorImpl::decref_pyobject`` -> ``take_gil`` -> ``PyThread_exit_thread``, and the
main thread in ``Py_FinalizeEx``.

So hvdlite holds every tensor it hands to Gloo here once the operation is complete,
until torch's reference to its Python object is gone (``released``), and at exit
(``torch_transport``'s atexit hook, before the interpreter finalizes) waits, with the
GIL released, until that is so for all of them. Held, a tensor's Python object cannot
die on Gloo's thread: a dying tensor releases and retakes the GIL in its deallocation,
so a weak reference, cleared early in it, would say "gone" while Gloo's thread still
needs the GIL (a core dump: ``THPVariable_clear`` -> ``take_gil``). Here Gloo's thread
only lowers the count, under the GIL and once; the object dies on a thread of Python's.
"""
from __future__ import annotations

import sys
import threading
import time
from typing import Any, Iterable

# Past _MOST, the oldest are let go unchecked, so that a tensor something else keeps
# alive cannot grow the list without bound.
_MOST = 4096
_PAUSE_S = 0.001


def _references(held: list[Any], index: int) -> int:
    return sys.getrefcount(held[index])


# The count of an object that only a list holds, measured the way ``released`` measures.
_HELD_ONLY_HERE = _references([object()], 0)


def released(held: list[Any], index: int) -> bool:
    """Whether nothing but ``held`` refers to its tensor at ``index``: no C++ holder is
    left (torch's own reference to the Python object is gone with the last one)."""
    return _references(held, index) == _HELD_ONLY_HERE


class Handoff:
    """The tensors of completed operations that Gloo may still hold; any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: list[Any] = []

    def hold(self, tensors: Iterable[Any]) -> None:
        """Hold ``tensors``, of an operation Gloo has completed, which the caller then
        lets go of, until Gloo has let go of them too."""
        with self._lock:
            self._sweep()
            self._held.extend(tensors)

    def _sweep(self) -> None:
        held = self._held
        self._held = [held[i] for i in range(len(held)) if not released(held, i)][-_MOST:]

    def alive(self) -> int:
        """How many of the tensors held Gloo (or anything else) still holds too."""
        with self._lock:
            self._sweep()
            return len(self._held)

    def await_released(self, timeout_s: float) -> bool:
        """Wait, sleeping (the GIL released, so that Gloo's threads can take it), until
        Gloo has let go of every tensor held; False if some are held after
        ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while self.alive():
            if time.monotonic() >= deadline:
                return False
            time.sleep(_PAUSE_S)
        return True


HANDOFF = Handoff()
