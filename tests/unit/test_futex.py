"""Sleeping on a word of shared memory (hvdlite/core/futex.py): a changed word ends a
wait at once, an unchanged one sleeps to its limit, and a store plus a wake-up from
another process ends the sleep early (the case node_memory.py relies on)."""
from __future__ import annotations

import mmap
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from hvdlite.core import futex

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not futex.available(), reason="futex: x86-64 Linux only")]

_STORE_AND_MAYBE_WAKE = """
import mmap, sys, time
import numpy as np
from hvdlite.core import futex
with open(sys.argv[1], "r+b") as file:
    shared = mmap.mmap(file.fileno(), 4096)
counter = np.frombuffer(shared, dtype=np.int64, count=1)
time.sleep(0.2)
counter[0] = 7
if sys.argv[2] == "wake":
    futex.Word(counter).wake()
"""


def _counter(path: Path) -> np.ndarray:
    path.write_bytes(bytes(4096))
    with open(path, "r+b") as file:
        shared = mmap.mmap(file.fileno(), 4096)
    return np.frombuffer(shared, dtype=np.int64, count=1)


def test_a_word_that_changed_already_ends_the_wait_at_once(tmp_path: Path) -> None:
    counter = _counter(tmp_path / "word")
    counter[0] = 3
    started = time.monotonic()
    futex.Word(counter).wait(2, timeout_s=5.0)
    assert time.monotonic() - started < 1.0


def test_an_unchanged_word_sleeps_to_the_limit_taking_no_cpu(tmp_path: Path) -> None:
    counter = _counter(tmp_path / "word")
    started, cpu = time.monotonic(), time.thread_time()
    futex.Word(counter).wait(0, timeout_s=0.3)
    assert 0.25 < time.monotonic() - started < 3.0
    assert time.thread_time() - cpu < 0.05


@pytest.mark.parametrize("wakes", [True, False], ids=["store and wake", "store only"])
def test_another_process_that_stores_and_wakes_ends_the_sleep(tmp_path: Path,
                                                              wakes: bool) -> None:
    """The wake-up is what ends it: a store alone is seen only at the limit."""
    path = tmp_path / "word"
    counter = _counter(path)
    peer = subprocess.Popen([sys.executable, "-c", _STORE_AND_MAYBE_WAKE, str(path),
                             "wake" if wakes else "store"])
    try:
        started = time.monotonic()
        futex.Word(counter).wait(0, timeout_s=4.0)
        waited = time.monotonic() - started
    finally:
        assert peer.wait(timeout=30) == 0
    assert counter[0] == 7 or not wakes
    assert (waited < 3.0) if wakes else (waited >= 3.9)
