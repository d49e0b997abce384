"""Handles and the engine's doorbell, without MPI: what synchronize() waits on,
what it returns or raises, and how user threads wake a sleeping engine."""
from __future__ import annotations

import threading
import time

import pytest

from hvdlite.core.handles import HandleTable
from hvdlite.core.waiting import Doorbell
from hvdlite.errors import HvdliteError


def test_handles_are_distinct_and_complete_with_their_own_result() -> None:
    table = HandleTable()
    first, second = table.create(), table.create(lambda result: result * 10)
    assert first != second
    assert not table.poll(first) and not table.poll(second)
    table.complete(second, 4)
    table.complete(first, "a")
    assert table.poll(first) and table.poll(second)
    assert table.wait(second) == 40                  # finish runs on the waiting thread
    assert table.wait(first) == "a"


def test_a_handle_is_forgotten_once_waited_and_unknown_ones_are_refused() -> None:
    table = HandleTable()
    handle = table.create()
    table.complete(handle, None)
    table.wait(handle)
    for bad in (handle, 999, "x", None):
        with pytest.raises(HvdliteError, match="unknown"):
            table.wait(bad)
        with pytest.raises(HvdliteError, match="unknown"):
            table.poll(bad)


def test_the_first_outcome_wins() -> None:
    table = HandleTable()
    done, failed = table.create(), table.create()
    table.complete(done, 1)
    table.fail(done, HvdliteError("late failure"))
    table.fail(failed, HvdliteError("it failed"))
    table.complete(failed, 2)
    table.complete(done, 3)
    assert table.wait(done) == 1
    with pytest.raises(HvdliteError, match="it failed"):
        table.wait(failed)
    table.complete(done, 4)              # forgotten handles: late outcomes are ignored
    table.fail(12345, HvdliteError("never created"))


def test_completion_is_seen_only_after_notify_and_wakes_a_waiter() -> None:
    table = HandleTable()
    handle = table.create()
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(table.wait(handle)))
    waiter.start()
    deadline = time.monotonic() + 5
    while table.waiting == 0 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert table.waiting == 1                        # tells the engine someone waits
    table.complete(handle, "result")
    table.notify()
    waiter.join(5)
    assert got == ["result"] and table.waiting == 0


def test_fail_all_fails_every_pending_handle_and_wakes_waiters() -> None:
    table = HandleTable()
    handles = [table.create() for _ in range(3)]
    table.complete(handles[0], "kept")
    table.fail_all(HvdliteError("engine stopped"))
    assert table.wait(handles[0]) == "kept"
    for handle in handles[1:]:
        with pytest.raises(HvdliteError, match="engine stopped"):
            table.wait(handle)


def test_the_doorbell_wakes_a_listener_once_and_only_while_it_listens() -> None:
    bell = Doorbell()
    bell.ring()                                      # nobody listens: nothing to wake
    started = time.monotonic()
    assert bell.listen(0.05, lambda: False) is False     # slept the whole timeout
    assert time.monotonic() - started >= 0.04
    assert bell.listen(5.0, lambda: True) is True        # work already there: no sleep
    woke: list = []
    listener = threading.Thread(target=lambda: woke.append(bell.listen(5.0, lambda: False)))
    started = time.monotonic()
    listener.start()
    deadline = time.monotonic() + 5
    while not bell.listening and time.monotonic() < deadline:
        time.sleep(0.001)
    bell.ring()
    listener.join(5)
    assert woke == [True] and time.monotonic() - started < 4
    assert not bell.listening
