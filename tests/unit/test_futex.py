"""Sleeping on a word of shared memory (hvdlite/transport/futex.py): a changed word ends a
wait at once, an unchanged one sleeps to its limit, and a store plus a wake-up from
another process ends the sleep early (the case node_memory.py relies on).

Events are ordered by events, not by sleeps: the other process stores only once the
kernel reports this process's thread asleep on the word (/proc's syscall file), and
tells when it has. The time bounds left are the promises: "at once" and "to its limit"
against limits far apart."""
from __future__ import annotations

import mmap
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from hvdlite.transport import futex

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not futex.available(), reason="futex: x86-64 Linux only")]

# Stores 7 when told to, then wakes the word's sleepers (at once, or when told again).
_STORE_THEN_WAKE = """
import mmap, sys
import numpy as np
from hvdlite.transport import futex
with open(sys.argv[1], "r+b") as file:
    shared = mmap.mmap(file.fileno(), 4096)
counter = np.frombuffer(shared, dtype=np.int64, count=1)
print("ready", flush=True)
assert sys.stdin.readline() == "store\\n"
counter[0] = 7
if sys.argv[2] == "store only":
    print("stored", flush=True)
    assert sys.stdin.readline() == "wake\\n"
futex.Word(counter).wake()
print("woke", flush=True)
"""
_FUTEX_SYSCALL = "202"     # x86-64


def _counter(path: Path) -> np.ndarray:
    path.write_bytes(bytes(4096))
    with open(path, "r+b") as file:
        shared = mmap.mmap(file.fileno(), 4096)
    return np.frombuffer(shared, dtype=np.int64, count=1)


def _asleep_on(thread: threading.Thread, counter: np.ndarray) -> bool:
    """Whether ``thread`` is blocked in futex() on ``counter``'s address, as the kernel
    says (/proc/self/task/TID/syscall: the call's number, then its arguments)."""
    try:
        fields = Path(f"/proc/self/task/{thread.native_id}/syscall").read_text().split()
    except OSError:                     # the thread has ended
        return False
    return fields[:2] == [_FUTEX_SYSCALL, hex(counter.ctypes.data)]


def _until_asleep(thread: threading.Thread, counter: np.ndarray) -> None:
    deadline = time.monotonic() + 60
    while not _asleep_on(thread, counter):
        assert thread.is_alive() and time.monotonic() < deadline, "never went to sleep"
        time.sleep(0.001)


def test_a_word_that_changed_already_ends_the_wait_at_once(tmp_path: Path) -> None:
    counter = _counter(tmp_path / "word")
    counter[0] = 3
    started = time.monotonic()
    futex.Word(counter).wait(2, timeout_s=60.0)
    assert time.monotonic() - started < 30.0          # not at the limit


def test_an_unchanged_word_sleeps_to_the_limit_taking_no_cpu(tmp_path: Path) -> None:
    counter = _counter(tmp_path / "word")
    started, cpu = time.monotonic(), time.thread_time()
    futex.Word(counter).wait(0, timeout_s=0.3)
    assert 0.25 < time.monotonic() - started < 10.0   # the limit, not forever
    assert time.thread_time() - cpu < 0.05


@pytest.mark.parametrize("mode", ["store and wake", "store only"])
def test_another_process_that_stores_and_wakes_ends_the_sleep(tmp_path: Path,
                                                              mode: str) -> None:
    """The wake-up is what ends it: after a store alone the sleeper sleeps on."""
    path = tmp_path / "word"
    counter = _counter(path)
    sleeper = threading.Thread(target=futex.Word(counter).wait, args=(0, 600.0), daemon=True)
    peer = subprocess.Popen([sys.executable, "-c", _STORE_THEN_WAKE, str(path), mode],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert peer.stdin is not None and peer.stdout is not None
    try:
        assert peer.stdout.readline() == "ready\n"
        sleeper.start()
        _until_asleep(sleeper, counter)
        peer.stdin.write("store\n")
        peer.stdin.flush()
        if mode == "store only":
            assert peer.stdout.readline() == "stored\n" and counter[0] == 7
            sleeper.join(0.5)
            assert _asleep_on(sleeper, counter), "a store alone ended the sleep"
            peer.stdin.write("wake\n")
            peer.stdin.flush()
        assert peer.stdout.readline() == "woke\n"
        sleeper.join(30)                                # a wake-up takes microseconds
        assert not sleeper.is_alive(), "the wake-up did not end the sleep"
        assert counter[0] == 7
    finally:
        peer.stdin.close()
        peer.wait(timeout=60)
        if sleeper.is_alive():                          # left asleep by a failure above
            futex.Word(counter).wake()
            sleeper.join(5)
    assert peer.returncode == 0
