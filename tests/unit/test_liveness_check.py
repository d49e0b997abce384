"""The liveness check around the Monitor, in one process: Liveness.check with a
recording channel, and the channel's pings and verdicts and the awaited gather and
bcast on this process's own one-rank MPI world (the Monitor, the process checks and
the messages are in test_liveness.py)."""
from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from mpi4py import MPI

from hvdlite.failure import liveness
from hvdlite.failure.liveness import EXITED, RUNNING, Liveness, Monitor, Peer
from hvdlite.transport import peers
from hvdlite.transport import mpi_transport
from hvdlite.transport.mpi_transport import Channel, MpiTransport

DOMAIN = ("vm", "boot-1", "pid:[4026531836]")
TICK = 0.1                                   # MPI's idle tick
OVERDUE = liveness.OVERDUE_TICKS * TICK


class FakeChannel:
    def __init__(self) -> None:
        self.inbox: tuple[set[int], list[tuple[int, str]]] = (set(), [])
        self.pinged: list[list[int]] = []
        self.told: list[tuple[list[int], str]] = []

    def drain(self) -> tuple[set[int], list[tuple[int, str]]]:
        heard, verdicts = self.inbox
        self.inbox = (set(), [])
        return heard, verdicts

    def ping(self, ranks: list[int]) -> None:
        self.pinged.append(list(ranks))

    def tell(self, ranks: list[int], text: str) -> None:
        self.told.append((list(ranks), text))


def checker(states: dict[int, str], timeout: float = 5.0, size: int = 3) -> Any:
    """A Liveness of rank 0 among ``size`` same-host ranks, with a recording channel."""
    peers = [Peer(r, "vm", 1000 + r, 5, DOMAIN) for r in range(size)]
    live = Liveness.__new__(Liveness)
    live.me, live.timeout, live.peers = 0, timeout, peers
    live.monitor = Monitor(0, peers, timeout, idle_tick_s=TICK,
                           probe=lambda p: states.get(p.rank, RUNNING))
    live.channel = FakeChannel()
    return live


def test_nothing_happens_before_the_round_is_overdue() -> None:
    live = checker({1: EXITED})
    assert live.check(started=10.0, now=10.0 + OVERDUE / 2) is None
    assert live.channel.pinged == [] and live.channel.told == []


def test_an_overdue_round_pings_every_peer_and_a_live_set_is_fine() -> None:
    live = checker({})
    assert live.check(started=10.0, now=11.0) is None
    assert live.channel.pinged == [[1, 2]] and live.channel.told == []
    assert live.check(started=10.0, now=11.01) is None      # the next ping is not due yet
    assert live.channel.pinged == [[1, 2]]


def test_a_lost_peer_is_told_to_the_survivors_and_reported() -> None:
    live = checker({2: EXITED}, timeout=7.0)
    message = live.check(started=10.0, now=11.0)
    assert message is not None
    assert message.startswith("rank 0: lost a peer: rank 2 (pid 1002 on vm) exited.")
    assert "detected by" not in message and "HVDLITE_PEER_TIMEOUT=7 s" in message
    assert live.channel.told == [([1], "rank 2 (pid 1002 on vm) exited")]


def test_a_verdict_from_another_rank_is_adopted_at_once() -> None:
    live = checker({})
    live.channel.inbox = ({2}, [(2, "rank 1 (pid 9 on b) exited"), (1, "other")])
    message = live.check(started=10.0, now=10.0)              # not even overdue yet
    assert message is not None
    assert message.startswith("rank 0: lost a peer: rank 1 (pid 9 on b) exited "
                              "(detected by rank 2).")
    assert live.channel.pinged == [] and live.channel.told == []


def test_a_peer_heard_from_is_not_silent() -> None:
    live = checker({}, timeout=2.0)
    assert live.check(started=10.0, now=11.0) is None
    live.channel.inbox = ({1}, [])                            # rank 1's ping arrives
    assert live.check(started=10.0, now=11.5) is None
    message = live.check(started=10.0, now=12.5)              # rank 2 silent 2.5 s
    assert message is not None and "rank 2 (pid 1002 on vm) stopped answering for 2.5 s" in message
    assert "rank 1 (pid" not in message                      # heard 1 s ago
    assert live.channel.told[0][0] == [1]


# -- on this process's own MPI world (one rank) -------------------------------------------------

def test_liveness_starts_with_every_ranks_identity() -> None:
    live = Liveness(MpiTransport(MPI.COMM_WORLD), SimpleNamespace(peer_timeout=3.0,
                                                                  cycle_time=5.0))
    try:
        assert live.me == MPI.COMM_WORLD.Get_rank() and live.timeout == 3.0
        assert live.monitor.overdue_s == pytest.approx(OVERDUE)
        assert [p.pid for p in live.peers] == [os.getpid()] * MPI.COMM_WORLD.Get_size()
        assert live.monitor.timeout == 3.0 and live.monitor.peers == []
        assert live.channel.comm != MPI.COMM_WORLD
        assert live.check(started=0.0, now=100.0) is None     # nobody else: nothing lost
    finally:
        live.channel.comm.Free()


@pytest.mark.timeout(30)
def test_pings_and_verdicts_arrive_on_the_private_channel() -> None:
    channel = Channel(MPI.COMM_WORLD)
    me = MPI.COMM_WORLD.Get_rank()
    try:
        assert channel.drain() == (set(), [])
        channel.ping([me])
        channel.ping([me])                                 # delivered already: sent again
        channel.tell([me], "rank 3 (pid 1 on x) exited")
        heard, verdicts = channel.drain()
        assert heard == {me} and verdicts == [(me, "rank 3 (pid 1 on x) exited")]
        assert channel.drain() == (set(), [])              # both pings were received
        assert not MPI.COMM_WORLD.Iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG)
    finally:
        channel.comm.Free()


def test_a_ping_not_yet_delivered_is_not_sent_again() -> None:
    channel = Channel.__new__(Channel)
    sent: list[int] = []
    pending = SimpleNamespace(Test=lambda: False)
    delivered = SimpleNamespace(Test=lambda: True)
    channel.comm = SimpleNamespace(Isend=lambda buf, dest, tag: sent.append(dest) or pending)
    channel._ping = None
    channel._pings = {1: pending, 2: delivered}
    channel.ping([1, 2, 3])
    assert sent == [2, 3]


@pytest.mark.parametrize("obj", [{"a": [1, 2]}, "x" * 1000, None])
def test_awaited_gather_and_bcast_on_one_rank(obj: object) -> None:
    comm = MpiTransport(MPI.COMM_SELF.Dup())
    waited: list[int] = []

    def wait(requests: list) -> None:
        waited.append(len(requests))
        MPI.Request.Waitall(requests)
    try:
        assert comm.gather_awaited(obj, wait) == [obj]
        assert comm.bcast_awaited(obj, wait) == obj
    finally:
        comm.free()
    assert waited == [1, 1, 1, 1]


@pytest.mark.parametrize("idle_tick_s, cycle_ms, overdue_s", [
    (0.1, 5.0, 0.5), (0.4, 5.0, 2.0), (0.1, 300.0, 1.5), (0.4, 600.0, 3.0)])
def test_a_round_is_overdue_after_five_of_the_ticks_its_idle_engines_sleep(
        idle_tick_s: float, cycle_ms: float, overdue_s: float) -> None:
    """The transport's tick, or one cycle where that is longer, as waiting.IdleTicks
    sleeps: a round is never overdue merely because a peer slept its tick."""
    world = MpiTransport(MPI.COMM_WORLD)
    world.idle_tick_s = idle_tick_s
    live = Liveness(world, SimpleNamespace(peer_timeout=3.0, cycle_time=cycle_ms))
    try:
        assert live.monitor.overdue_s == pytest.approx(overdue_s)
    finally:
        live.channel.comm.Free()


@pytest.mark.parametrize("timeout,interval", [(0.0, 2.0), (-1.0, 2.0), (0.5, 0.25), (1.0, 0.25),
                                              (8.0, 1.0), (10.0, 1.25), (16.0, 2.0),
                                              (100.0, 2.0)])
def test_a_peer_pings_eight_times_per_timeout_within_bounds(timeout: float,
                                                            interval: float) -> None:
    assert liveness.ping_interval(timeout) == interval


def test_local_processes_are_probed_every_half_second() -> None:
    probed: list[float] = []
    now = [0.0]
    peers = [Peer(r, "vm", 1000 + r, 5, DOMAIN) for r in range(2)]
    monitor = Monitor(0, peers, 5.0, idle_tick_s=TICK,
                      probe=lambda p: probed.append(now[0]) or RUNNING)
    assert monitor.overdue(started=10.0, now=11.0)
    for now[0] in (11.0, 11.25, 11.375, 11.5, 11.75, 12.0):
        assert monitor.assess(now[0]) == []
    assert probed == [11.0, 11.5, 12.0]


def test_a_peer_is_a_value() -> None:
    peer = Peer(1, "vm", 10, 5, DOMAIN)
    assert peer == Peer(1, "vm", 10, 5, DOMAIN) and len({peer, peer}) == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        peer.pid = 11  # type: ignore[misc]


def test_identity_without_a_visible_pid_namespace_has_no_domain(tmp_path: Path) -> None:
    (tmp_path / "self").mkdir()
    fields = ["S"] + ["0"] * 18 + ["4321", "0"]
    (tmp_path / "self" / "stat").write_text("99 (py thon) " + " ".join(fields) + "\n")
    (tmp_path / "sys" / "kernel" / "random").mkdir(parents=True)
    (tmp_path / "sys" / "kernel" / "random" / "boot_id").write_text("boot-7\n")
    me = peers.identity(3, proc=str(tmp_path))
    assert (me.rank, me.pid, me.start, me.domain) == (3, os.getpid(), 4321, None)
    (tmp_path / "self" / "ns").mkdir()
    os.symlink("pid:[77]", tmp_path / "self" / "ns" / "pid")
    me = peers.identity(3, proc=str(tmp_path))
    assert me.domain == (socket.gethostname(), "boot-7", "pid:[77]")


def test_the_signal_probe_only_asks_whether_a_process_exists() -> None:
    child = subprocess.Popen(["sleep", "30"])
    try:
        assert peers._signal_probe(child.pid) == peers.UNKNOWN
        time.sleep(0.1)
        assert child.poll() is None                        # no signal was delivered
    finally:
        child.kill()
        child.wait()
    assert peers._signal_probe(child.pid) == EXITED


def test_a_verdict_is_waited_for_at_most_half_a_second(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [50.0]

    def sleep(seconds: float) -> None:
        clock[0] += seconds

    monkeypatch.setattr(mpi_transport, "time", SimpleNamespace(monotonic=lambda: clock[0],
                                                               sleep=sleep))
    monkeypatch.setattr(mpi_transport, "MPI", SimpleNamespace(Request=SimpleNamespace(
        Testall=lambda requests: False)))                  # never delivered: a broken peer
    channel = Channel.__new__(Channel)
    sent: list[tuple[int, str]] = []
    channel.comm = SimpleNamespace(isend=lambda text, dest, tag: sent.append((dest, text)))
    channel.tell([1, 2], "rank 3 exited")
    assert sent == [(1, "rank 3 exited"), (2, "rank 3 exited")]
    assert 0.5 <= clock[0] - 50.0 < 0.5 + 2e-3


def test_a_process_of_another_user_is_not_judged(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(pid: int, signal: int) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(peers, "os", SimpleNamespace(kill=refuse))
    assert peers._signal_probe(1) == peers.UNKNOWN


def test_a_loss_is_a_value() -> None:
    loss = liveness.Loss(Peer(1, "vm", 10, 5, DOMAIN), EXITED, 0.0)
    assert len({loss, loss}) == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        loss.how = RUNNING  # type: ignore[misc]


def test_the_monitor_watches_every_rank_but_its_own() -> None:
    peers = [Peer(r, "vm", 1000 + r, 5, DOMAIN) for r in range(3)]
    assert [p.rank for p in Monitor(1, peers, 5.0, idle_tick_s=TICK).peers] == [0, 2]
    many = [Peer(r, "vm", 1000 + r, 5, DOMAIN) for r in range(302)]
    rank = int("300")                                       # not a cached int
    watched = [p.rank for p in Monitor(rank, many, 5.0, idle_tick_s=TICK).peers]
    assert 300 not in watched and len(watched) == 301


def test_local_peers_are_those_of_an_equal_process_domain() -> None:
    same = tuple(list(DOMAIN))                             # equal, as unpickled from a peer
    other = ("zz", "boot-9", "pid:[1]")                    # sorts after this domain
    peers = [Peer(0, "vm", 1000, 5, DOMAIN), Peer(1, "vm", 1001, 5, same),
             Peer(2, "zz", 1002, 5, other), Peer(3, "x", 1003, 5, None)]
    assert [p.rank for p in Monitor(0, peers, 5.0, idle_tick_s=TICK).local] == [1]
    assert Monitor(3, peers, 5.0, idle_tick_s=TICK).local == []   # its own domain unknown


def test_the_same_wait_keeps_what_it_heard_and_pings_again_when_due() -> None:
    peers = [Peer(r, "far", 1000 + r, 5, None) for r in range(2)]
    monitor = Monitor(0, peers, timeout=5.0, idle_tick_s=TICK)    # a ping every 0.625 s
    assert monitor.overdue(float("10.0"), 11.0) and monitor.ping_due(11.0)
    monitor.heard(1, 14.0)
    assert monitor.overdue(float("10.0"), 16.5)            # equal start: the same wait
    assert monitor.assess(16.5) == []                       # heard 2.5 s ago, not 6.5
    assert monitor.ping_due(16.5) and not monitor.ping_due(16.6)


def test_a_sub_second_timeout_is_a_timeout() -> None:
    far = [Peer(r, "far", 1000 + r, 5, None) for r in range(2)]
    monitor = Monitor(0, far, timeout=0.5, idle_tick_s=TICK)
    assert monitor.overdue(10.0, 10.5)
    (loss,) = monitor.assess(11.0)
    assert loss.peer.rank == 1 and loss.how == peers.UNKNOWN and loss.silent_for == 1.0


def test_drain_forgets_delivered_pings_only() -> None:
    channel = Channel.__new__(Channel)
    sent: list[int] = []
    pending = SimpleNamespace(Test=lambda: False)
    delivered = SimpleNamespace(Test=lambda: True)
    channel.comm = SimpleNamespace(
        Iprobe=lambda source, tag, status: False,
        Isend=lambda buf, dest, tag: sent.append(dest) or pending)
    channel._ping, channel._status = None, None
    channel._pings = {1: pending, 2: delivered}
    assert channel.drain() == (set(), [])
    assert channel._pings == {1: pending}
    channel.ping([1, 2])
    assert sent == [2]                                      # 1's ping is still on its way
