"""Handles and the engine's doorbell, without MPI: what synchronize() waits on,
what it returns or raises, and how user threads wake a sleeping engine."""
from __future__ import annotations

import threading
import time

import pytest

from hvdlite.engine.handles import HandleTable
from hvdlite.errors import HvdliteError
from hvdlite.failure.waiting import Doorbell


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
    for bad in (handle, 999, "x", None, [handle]):      # a list: unhashable
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
    listener = threading.Thread(target=lambda: woke.append(bell.listen(30.0, lambda: False)))
    listener.start()
    _until_listening(bell)
    bell.ring()
    listener.join(60)
    assert woke == [True]                            # woken by the ring, not at its limit
    assert not bell.listening


def _until_listening(bell: Doorbell) -> None:
    deadline = time.monotonic() + 30
    while not bell.listening:
        assert time.monotonic() < deadline, "the listener never listened"
        time.sleep(0.001)


def _wait_until_parked(table: HandleTable, count: int) -> None:
    deadline = time.monotonic() + 30
    while table.waiting < count and time.monotonic() < deadline:
        time.sleep(0.001)
    assert table.waiting == count


def test_a_parked_waiter_wakes_at_notify_not_at_complete() -> None:
    """A completion is seen by a blocked waiter only at notify(), and wakes it then."""
    table = HandleTable()
    handle = table.create()
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(table.wait(handle)))
    waiter.start()
    _wait_until_parked(table, 1)
    table.complete(handle, "result")
    waiter.join(0.1)
    assert waiter.is_alive() and got == []           # the engine wakes waiters in batches
    table.notify()
    table.notify()                                   # a second notify releases nothing twice
    waiter.join(30)
    assert got == ["result"] and table.waiting == 0


def test_notify_wakes_only_the_waiters_whose_handles_are_done() -> None:
    table = HandleTable()
    first, second = table.create(), table.create()
    got: dict = {}

    def wait(handle: int) -> None:
        try:
            got[handle] = table.wait(handle)
        except HvdliteError as error:
            got[handle] = error
    waiters = [threading.Thread(target=wait, args=(h,)) for h in (first, second)]
    for waiter in waiters:
        waiter.start()
    _wait_until_parked(table, 2)
    table.complete(second, "two")
    table.notify()
    waiters[1].join(30)
    assert got == {second: "two"} and waiters[0].is_alive() and table.waiting == 1
    table.fail(first, HvdliteError("boom"))
    table.notify()
    waiters[0].join(30)
    assert not waiters[0].is_alive() and table.waiting == 0
    assert isinstance(got[first], HvdliteError) and "boom" in str(got[first])


@pytest.mark.timeout(60)
def test_no_wake_up_is_lost_when_completion_races_with_waiting() -> None:
    """The engine thread completes and notifies each step just as the user threads
    start waiting for it, at varied moments; every wait must return (a lost
    wake-up hangs here and the joins time out)."""
    table = HandleTable()
    rounds, users = 1000, 2
    handles = [[table.create() for _ in range(rounds)] for _ in range(users)]
    results: list[list] = [[] for _ in range(users)]
    reached = [-1] * users

    def user(index: int) -> None:
        for step, handle in enumerate(handles[index]):
            reached[index] = step
            results[index].append(table.wait(handle))

    def engine() -> None:
        for step in range(rounds):
            while min(reached) < step:
                time.sleep(0)
            for _ in range(step % 7):
                time.sleep(0)                        # complete at varied points of the wait
            for index in range(users):
                table.complete(handles[index][step], step)
            table.notify()

    threads = [threading.Thread(target=user, args=(i,), daemon=True) for i in range(users)]
    threads.append(threading.Thread(target=engine, daemon=True))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert not any(thread.is_alive() for thread in threads), f"stuck at {reached}"
    assert results == [list(range(rounds))] * users


def test_concurrent_rings_wake_the_listener_once_and_leave_no_stale_ring() -> None:
    bell = Doorbell()
    woke: list = []
    listener = threading.Thread(target=lambda: woke.append(bell.listen(30.0, lambda: False)))
    listener.start()
    _until_listening(bell)
    ringers = [threading.Thread(target=bell.ring) for _ in range(4)]
    ringers.append(threading.Thread(target=bell.ring_always))
    for ringer in ringers:
        ringer.start()
    for ringer in ringers:
        ringer.join(30)
    listener.join(60)
    assert woke == [True]
    started = time.monotonic()
    assert bell.listen(0.05, lambda: False) is False  # the extra rings were cleared
    assert time.monotonic() - started >= 0.04
