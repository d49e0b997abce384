"""Starting the exit guard, and its wait for the rank where pidfd_open is missing
(the guard's own lifetime is in test_liveness.py). A socketpair stands in for
hydra's PMI socket."""
from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace
from typing import Callable, Iterator, Optional

import pytest

from hvdlite.failure import exit_guard


@pytest.fixture
def pmi() -> Iterator[tuple[socket.socket, socket.socket]]:
    """(launcher's end, rank's end) of a PMI socket; no guard started before."""
    launcher, rank = socket.socketpair()
    saved = exit_guard._spawned
    exit_guard._spawned = None
    try:
        yield launcher, rank
    finally:
        guard = exit_guard._spawned
        exit_guard._spawned = saved
        launcher.close()
        rank.close()
        if guard is not None:
            guard.kill()
            guard.wait()


def open_files(pid: int) -> list[str]:
    """What pid's descriptors point at. The guard may still be starting Python, which
    opens and closes files of its own: one gone between listing and reading is skipped."""
    held = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(FileNotFoundError):
            held.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return held


def hydra(fd: int) -> dict[str, str]:
    return {"PMI_FD": str(fd), "MPI_LOCALNRANKS": "2"}


@pytest.mark.timeout(60)
def test_spawn_starts_one_guard_holding_the_pmi_socket_and_copies_of_the_output(
        pmi: tuple[socket.socket, socket.socket]) -> None:
    launcher, rank = pmi
    read, write = os.pipe()
    os.set_inheritable(write, True)                    # like a launcher's pipe: not passed on
    try:
        guard = exit_guard.spawn(hydra(rank.fileno()), peer_timeout=20.0)
        pipe = f"pipe:[{os.fstat(write).st_ino}]"
    finally:
        os.close(read)
        os.close(write)
    assert guard is not None
    *args, launcher_pid, out, err = guard.args
    assert launcher_pid == str(os.getppid())          # hydra's proxy, whose children are ranks
    for copy in (out, err):            # made for the guard, closed here again
        with pytest.raises(OSError):
            os.fstat(int(copy))
    assert args == [sys.executable, "-I", "-S", os.path.abspath(exit_guard.__file__),
                    str(os.getpid()), str(rank.fileno()), "30.0",    # 20 s + MARGIN_S
                    repr(exit_guard.HOLD_S)]
    assert exit_guard.spawn(hydra(rank.fileno()), peer_timeout=5.0) is guard   # once
    if os.path.isdir(f"/proc/{guard.pid}/fd"):
        for std in (0, 1, 2):
            assert os.readlink(f"/proc/{guard.pid}/fd/{std}") == os.devnull
        held = open_files(guard.pid)
        assert pipe not in held
        # The rank's own stdout and stderr, under other numbers.
        assert os.readlink(f"/proc/{guard.pid}/fd/{out}") == os.readlink("/proc/self/fd/1")
        assert os.readlink(f"/proc/{guard.pid}/fd/{err}") == os.readlink("/proc/self/fd/2")
    assert os.getpgid(guard.pid) == os.getpgrp()       # killed with the rank's group
    assert guard.poll() is None                         # holds it while the rank lives
    launcher.close()                                    # the launcher is done with it
    assert guard.wait(timeout=20) == 0


def test_nothing_to_guard_outside_hydra(pmi: tuple[socket.socket, socket.socket]) -> None:
    _, rank = pmi
    assert exit_guard.spawn({"PMI_FD": str(rank.fileno())}, 20.0) is None
    assert exit_guard.spawn({}, 20.0) is None
    assert exit_guard._spawned is None


def test_a_guard_that_cannot_start_is_a_warning(
        pmi: tuple[socket.socket, socket.socket], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    _, rank = pmi

    def cannot(*args: object, **kwargs: object) -> None:
        raise OSError("no more processes")

    monkeypatch.setattr(exit_guard, "subprocess", SimpleNamespace(
        Popen=cannot, DEVNULL=subprocess.DEVNULL))
    logger = logging.getLogger("hvdlite")
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger="hvdlite"):
            assert exit_guard.spawn(hydra(rank.fileno()), 20.0) is None
    finally:
        logger.removeHandler(caplog.handler)
    assert "could not start the exit guard" in caplog.text and "no more processes" in caplog.text


class OldKernelOs:
    """os for the guard where pidfd_open is missing; getppid answers the test's
    parent (fresh ints, as the kernel's would be) until the last answer."""

    def __init__(self, parents: list[int]) -> None:
        self.parents = parents
        self.asked = 0
        self.close = os.close

    def pidfd_open(self, pid: int) -> int:
        raise AttributeError("pidfd_open")

    def getppid(self) -> int:
        self.asked += 1
        answer = self.parents.pop(0) if len(self.parents) > 1 else self.parents[0]
        return int(str(answer))


def watching(rank: socket.socket) -> "select.poll":
    watch = select.poll()
    watch.register(rank.fileno(), select.POLLRDHUP)
    return watch


class Timed:
    """A poll object that records the timeout of each poll (in ms)."""

    def __init__(self, watch: "select.poll") -> None:
        self.watch, self.timeouts = watch, []

    def poll(self, timeout: Optional[float]) -> list:
        self.timeouts.append(timeout)
        return self.watch.poll(timeout)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("new_parent", [1, 99999])    # init, or a subreaper of any pid
def test_without_pidfd_the_guard_notices_it_was_reparented_at_its_next_check(
        monkeypatch: pytest.MonkeyPatch, pmi: tuple[socket.socket, socket.socket],
        new_parent: int) -> None:
    _, rank = pmi
    fake = OldKernelOs([4242, new_parent])
    monkeypatch.setattr(exit_guard, "os", fake)
    watch = Timed(watching(rank))
    started = time.monotonic()
    assert exit_guard._wait_for_parent(int("4242"), watch, rank.fileno()) is True
    assert fake.asked == 2                             # not before the parent changed
    assert watch.timeouts == [500.0, 500.0]            # checked every 0.5 s
    assert time.monotonic() - started >= 0.9


@pytest.mark.timeout(10)
def test_without_pidfd_the_guard_still_leaves_when_the_launcher_closes(
        monkeypatch: pytest.MonkeyPatch, pmi: tuple[socket.socket, socket.socket]) -> None:
    launcher, rank = pmi
    monkeypatch.setattr(exit_guard, "os", OldKernelOs([4242]))
    threading.Timer(0.2, launcher.close).start()
    assert exit_guard._wait_for_parent(4242, watching(rank), rank.fileno()) is False


@pytest.mark.timeout(10)
def test_the_guard_sees_its_rank_end_through_a_pidfd(
        pmi: tuple[socket.socket, socket.socket]) -> None:
    if not hasattr(os, "pidfd_open"):
        pytest.skip("no pidfd_open")
    _, rank = pmi
    parent = subprocess.Popen(["sleep", "30"])
    low = os.dup(rank.fileno())        # the lowest free fd: the pidfd gets a higher one
    watch = select.poll()
    watch.register(low, select.POLLRDHUP)
    threading.Timer(0.2, parent.kill).start()
    try:
        assert exit_guard._wait_for_parent(parent.pid, watch, low) is True
    finally:
        os.close(low)
        parent.kill()
        parent.wait()
    # A rank already gone (its pid reaped): pidfd_open fails, the guard checks its parent.
    assert exit_guard._wait_for_parent(parent.pid, watching(rank), rank.fileno()) is True


def _guard(parent: int, fd: int, grace: float, hold: float = 0.0, launcher: int = 0,
           held: tuple[int, ...] = ()) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-I", "-S", exit_guard.__file__, str(parent),
                             str(fd), str(grace), str(hold), str(launcher), *map(str, held)],
                            pass_fds=(fd, *held))


def _pidfds(pid: int) -> int:
    """How many pidfds process ``pid`` holds: the guard holds one while it watches its
    rank, and closes it once it has seen the rank end (none once it has ended)."""
    try:
        return sum(link == "anon_inode:[pidfd]" for link in open_files(pid))
    except FileNotFoundError:
        return 0


def _until(done: Callable[[], bool], what: str, limit: float = 60) -> None:
    deadline = time.monotonic() + limit
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def _kill_watched(parent: subprocess.Popen, guard: subprocess.Popen) -> float:
    """Kill the stand-in rank once its guard watches it (a pidfd), and return once the
    guard has seen the end (the pidfd closed): the grace runs from then. Returns when
    the kill was sent: the guard's grace starts after it."""
    try:
        os.close(os.pidfd_open(os.getpid()))
    except (AttributeError, OSError):
        pytest.skip("no pidfd_open: what the guard watches cannot be seen")
    _until(lambda: guard.poll() is None and _pidfds(guard.pid) == 1, "the guard never watched")
    killed = time.monotonic()
    parent.kill()
    parent.wait()
    _until(lambda: guard.poll() is not None or _pidfds(guard.pid) == 0,
           "the guard never saw its rank end")
    return killed


@contextlib.contextmanager
def rank_that_ended(grace: float) -> Iterator[tuple[socket.socket, subprocess.Popen, float]]:
    """A guard holding the rank's end of a socket pair for a stand-in rank (a sleep)
    that is then killed; yields the launcher's end, the guard, and when the kill was
    sent, once the guard has seen the end."""
    launcher, rank = socket.socketpair()
    parent = subprocess.Popen(["sleep", "60"])
    guard = _guard(parent.pid, rank.fileno(), grace)
    rank.close()
    try:
        yield launcher, guard, _kill_watched(parent, guard)
    finally:
        launcher.close()
        guard.kill()
        guard.wait()
        parent.kill()
        parent.wait()


@pytest.mark.timeout(120)
def test_a_short_grace_ends_on_time() -> None:
    """Held for the grace (0.2 s), and not for anything longer it might have taken
    instead (the peer timeout's MARGIN_S, 10 s): 5 s allows for a busy machine."""
    with rank_that_ended(0.2) as (launcher, guard, killed):
        launcher.settimeout(30)
        assert launcher.recv(1) == b""
        assert 0.2 <= time.monotonic() - killed < 5
        assert guard.wait(timeout=30) == 0


@pytest.mark.timeout(120)
def test_the_launcher_closing_during_the_grace_ends_the_guard() -> None:
    with rank_that_ended(60.0) as (launcher, guard, _):
        assert guard.poll() is None                    # in the grace period now
        launcher.close()
        assert guard.wait(timeout=30) == 0


@contextlib.contextmanager
def output_held(hold: float, launcher: int = 0) -> Iterator[tuple[socket.socket,
                                                                   subprocess.Popen, int]]:
    """A stand-in rank (a sleep) whose guard holds the rank's end of a PMI socket pair
    (grace 60 s) and the write end of a pipe standing for its output; yields the
    launcher's end of the socket, the guard and the pipe's read end, with the rank
    already killed."""
    launcher_end, rank_end = socket.socketpair()
    read, write = os.pipe()
    parent = subprocess.Popen(["sleep", "60"])
    guard = _guard(parent.pid, rank_end.fileno(), 60.0, hold, launcher, (write,))
    rank_end.close()
    os.close(write)
    try:
        _kill_watched(parent, guard)
        yield launcher_end, guard, read
    finally:
        os.close(read)
        launcher_end.close()
        guard.kill()
        guard.wait()
        parent.kill()
        parent.wait()


def _eof_after(read: int, limit: float) -> float:
    """Seconds until the pipe's writers are all gone (at most ``limit``)."""
    started = time.monotonic()
    ready, _, _ = select.select([read], [], [], limit)
    assert ready and os.read(read, 1) == b"", "the output is still held"
    return time.monotonic() - started


@pytest.mark.timeout(120)
def test_the_guard_holds_the_ranks_output_for_the_hold_then_keeps_only_the_socket() -> None:
    """Without other ranks to wait for (a rank alone on its host, or one started
    through a wrapper), the output is let go after ``hold``, the PMI socket later
    (the grace, 60 s: 30 s tells them apart on a busy machine)."""
    with output_held(hold=1.0) as (launcher, guard, read):
        assert 0.6 < _eof_after(read, 30) < 30
        assert guard.poll() is None                    # the socket is held for the grace
        launcher.settimeout(0.2)
        with pytest.raises(socket.timeout):
            launcher.recv(1)


@pytest.mark.timeout(120)
def test_the_guard_lets_go_of_the_output_once_the_other_ranks_have_ended() -> None:
    """Hydra's proxy is the parent of every rank on its host: this test process plays
    it, and a second sleep the other rank. Hydra kills the other ranks once a
    survivor reported the loss; the job ends when the guard then lets go (well
    before the hold, 60 s)."""
    other = subprocess.Popen(["sleep", "60"])
    try:
        with output_held(hold=60.0, launcher=os.getpid()) as (launcher, guard, read):
            ready, _, _ = select.select([read], [], [], 1.0)
            assert not ready                           # the other rank runs: held
            other.kill()                               # a zombie until waited for
            assert _eof_after(read, 30) < 30
            assert guard.poll() is None
    finally:
        other.kill()
        other.wait()
