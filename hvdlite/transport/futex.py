"""Sleeping until a word of shared memory changes, across processes: Linux's futex,
called through libc's ``syscall`` (x86-64 Linux, as hvdlite/transport/node_memory.py is).

A rank that waits for a peer's counter in the node's shared memory sleeps in the
kernel until the peer stores a new value and wakes it, instead of polling: polled,
the engine's waits for the transformer's rounds (ranks ~0.1 s apart in their backward
passes) cost it ~37 ms of CPU a step at np=4 on 2 cores (BENCHMARKS.md, "rounds sleep
on a futex"). The kernel compares the word with the value the waiter last saw before
it sleeps, so a store and wake-up between the waiter's read and its sleep is never
missed.
"""
from __future__ import annotations

import ctypes
import platform
from typing import Any, Optional

import numpy as np

_SYS_FUTEX_X86_64 = 202
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1    # shared (not FUTEX_PRIVATE_FLAG): other processes map it
_EVERYONE = 2 ** 31 - 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _load_syscall() -> Optional[Any]:
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return None
    try:
        call = ctypes.CDLL(None, use_errno=True).syscall    # releases the GIL while blocked
    except (OSError, AttributeError):
        return None
    call.restype = ctypes.c_long
    return call


_syscall = _load_syscall()


def available() -> bool:
    return _syscall is not None


class Word:
    """The low 32 bits of one int64 counter (little-endian: its first four bytes) in a
    shared mapping, which processes sleep on until it changes."""

    def __init__(self, counter: np.ndarray) -> None:
        assert _syscall is not None, "futex.Word needs x86-64 Linux (futex.available())"
        self._counter = counter     # its mapping must outlive the address taken below
        self._address = ctypes.c_void_p(counter.ctypes.data)
        self._wake_args = (ctypes.c_long(_SYS_FUTEX_X86_64), self._address,
                           ctypes.c_int(_FUTEX_WAKE), ctypes.c_int(_EVERYONE), None, None,
                           ctypes.c_int(0))

    def wait(self, seen: int, timeout_s: float) -> None:
        """Sleep until the counter is no longer ``seen``, a wake-up, or ``timeout_s``;
        returns at once where it has changed already. Callers read the counter again
        (a wake-up may be for another value, or spurious)."""
        seconds = max(timeout_s, 0.0)
        limit = _Timespec(int(seconds), int((seconds % 1.0) * 1e9))
        _syscall(ctypes.c_long(_SYS_FUTEX_X86_64), self._address, ctypes.c_int(_FUTEX_WAIT),
                 ctypes.c_uint32(seen & 0xFFFFFFFF), ctypes.byref(limit), None, ctypes.c_int(0))

    def wake(self) -> None:
        """Wake every process sleeping on this word (after a store to the counter)."""
        _syscall(*self._wake_args)
