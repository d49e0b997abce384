"""The sentinel (hvdlite/failure/sentinel.py) in one process: stand-in peers are child
processes of the test (``sleep``), killed to play a rank that dies; the engine's
side is the ``inside`` attribute, set by the test."""
from __future__ import annotations

import contextlib
import os
import subprocess
import threading
import time
from typing import Iterator, Optional

import pytest

from hvdlite.failure import liveness, sentinel
from hvdlite.failure.liveness import Peer
from hvdlite.failure.sentinel import GRACE_S, Sentinel
from hvdlite.transport import peers as processes

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not processes.identity(0).domain, reason="no /proc")]
# A loss is reported once the grace has passed, at the sentinel's next tick: far below
# the peer timeout (20 s here), which is what a sentinel that missed it would leave.
LOST_WITHIN_S = GRACE_S + 10


def _start_time(pid: int) -> int:
    text = processes._read(f"/proc/{pid}/stat")
    assert text is not None
    return int(processes._stat_fields(text)[19])


class Losses:
    """The sentinel's on_loss: the messages, and when the first came."""

    def __init__(self) -> None:
        self.messages: list[str] = []
        self.when: Optional[float] = None
        self.event = threading.Event()

    def __call__(self, message: str) -> None:
        self.messages.append(message)
        self.when = time.monotonic()
        self.event.set()


@contextlib.contextmanager
def ranks(count: int) -> Iterator[tuple[list[Peer], list[subprocess.Popen]]]:
    """This process as rank 0 and ``count`` stand-in peers on this host; yields the
    peers and their processes."""
    procs = [subprocess.Popen(["sleep", "60"]) for _ in range(count)]
    me = processes.identity(0)
    peers = [me] + [Peer(r + 1, me.host, p.pid, _start_time(p.pid), me.domain)
                    for r, p in enumerate(procs)]
    try:
        yield peers, procs
    finally:
        for child in procs:
            child.kill()
            child.wait()


def watching(peers: list[Peer], losses: Losses) -> Sentinel:
    watch = Sentinel(0, peers, 20.0, losses)
    watch.start()
    return watch


def test_a_peer_that_ends_inside_a_collective_is_lost_once_the_grace_has_passed() -> None:
    with ranks(2) as (peers, procs):
        losses = Losses()
        watch = watching(peers, losses)
        try:
            watch.inside = (time.monotonic(), (0, 1, 2))
            ended = time.monotonic()             # before the end: the grace runs after it
            procs[0].kill()                      # a zombie now: its parent has not reaped it
            assert losses.event.wait(30)
            assert GRACE_S <= losses.when - ended < LOST_WITHIN_S
            assert losses.messages == [liveness.error_message(
                0, f"rank 1 (pid {procs[0].pid} on {peers[0].host}) exited", None, 20.0)]
        finally:
            watch.stop()


def test_a_peer_ended_outside_a_collective_is_lost_once_the_engine_is_in_one() -> None:
    """A peer can end after a round is agreed and before the data collective starts."""
    with ranks(1) as (peers, procs):
        losses = Losses()
        watch = watching(peers, losses)
        try:
            procs[0].kill()
            assert not losses.event.wait(GRACE_S * 3)   # not waiting on anyone
            entered = time.monotonic()
            watch.inside = (entered, (0, 1))
            assert losses.event.wait(30)
            assert GRACE_S <= losses.when - entered < LOST_WITHIN_S
            assert f"rank 1 (pid {procs[0].pid} on " in losses.messages[0]
        finally:
            watch.stop()


def test_a_collective_without_the_ended_peer_does_not_lose_it() -> None:
    with ranks(2) as (peers, procs):
        losses = Losses()
        watch = watching(peers, losses)
        try:
            watch.inside = (time.monotonic(), (0, 2))   # a process set without rank 1
            procs[0].kill()
            assert not losses.event.wait(GRACE_S * 3)
        finally:
            watch.stop()


def test_without_pidfds_ended_peers_are_found_by_looking(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Kernels before 5.3, or a peer this user may not watch: /proc every 0.5 s."""
    monkeypatch.setattr(sentinel, "_pidfd", lambda pid: None)
    with ranks(1) as (peers, procs):
        losses = Losses()
        watch = watching(peers, losses)
        try:
            watch.inside = (time.monotonic(), (0, 1))
            procs[0].kill()
            assert losses.event.wait(30)
            assert f"rank 1 (pid {procs[0].pid} on " in losses.messages[0]
        finally:
            watch.stop()


def test_stop_ends_the_thread_and_closes_what_it_opened() -> None:
    with ranks(2) as (peers, _):
        watch = watching(peers, Losses())
        thread, fds = watch._thread, [*watch._watched, *watch._wake]
        watch.stop()
        assert thread is not None and not thread.is_alive()
        for fd in fds:
            with pytest.raises(OSError):
                os.fstat(fd)


def test_explain_names_an_ended_peer_or_gives_up_after_the_wait() -> None:
    with ranks(1) as (peers, procs):
        watch = Sentinel(0, peers, 20.0, Losses())
        started = time.monotonic()
        assert watch.explain(wait=0.3) is None
        assert time.monotonic() - started >= 0.3
        procs[0].kill()
        message = watch.explain(wait=30)
        assert message is not None and message.startswith(
            f"rank 0: lost a peer: rank 1 (pid {procs[0].pid} on ")


def test_nothing_is_watched_without_peers_on_this_host() -> None:
    me = processes.identity(0)
    far = Peer(1, "elsewhere", 4242, 1, ("elsewhere", "boot", "pid:[1]"))
    unknown = Peer(2, me.host, 4244, 1, None)
    watch = Sentinel(0, [me, far, unknown], 20.0, Losses())
    watch.start()
    assert watch.local == [] and watch._thread is None
    watch.inside = (0.0, (0, 1, 2))
    assert watch.losses(100.0) == [] and watch.explain(wait=0) is None
    watch.stop()
