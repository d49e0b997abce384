"""Which peer is gone, found while the engine waits on a round that does not complete.

Every live engine joins a negotiation round at least once per idle tick (its
transport's ``idle_tick_s``, 0.1 s over MPI and 0.4 s over Gloo, or one
HVDLITE_CYCLE_TIME if that is longer; waiting.IdleTicks), even while its user
thread computes, so a round still incomplete after OVERDUE_TICKS ticks means some
member's engine is busy in a long collective, frozen, or gone. While a round is
overdue, each waiting engine (on its own thread, from Engine._await):

1. pings every peer on the transport's private liveness channel and notes whose
   pings arrive: an engine that is waiting too is alive;
2. checks the processes of peers in the same process domain (same host, boot and
   PID namespace): a pid that no longer exists, is a zombie, or now belongs to a
   process started later has exited;
3. declares lost the peers that exited, at once, and the peers silent for longer
   than HVDLITE_PEER_TIMEOUT since the wait began ("stopped answering");
4. sends that verdict to every other peer, and adopts any verdict it receives,
   so every survivor fails, even those that cannot see the cause themselves.

Monitor and the helpers are pure logic (no transport) for unit tests.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

from hvdlite.transport.base import Transport
from hvdlite.transport.peers import (EXITED, RUNNING, STOPPED, UNKNOWN, Peer, identity,
                                     process_state)

# A waiting engine runs the stall inspector and this check this often. Rounds
# complete in well under this while every engine is alive, so the steady state never
# pays for either; a stuck round is looked at ten times a second.
TICK_S = 0.1
# While every engine is alive a round completes within one idle tick, in microseconds
# to milliseconds once every rank has joined; past this many ticks (0.5 s over MPI,
# 2 s over Gloo), checking costs nothing that matters. Only the wait before an
# exited peer is found grows with the tick; a silent one is waited for
# HVDLITE_PEER_TIMEOUT, far longer, whatever the tick.
OVERDUE_TICKS = 5
# Same-host process checks read one small /proc file per local peer; twice a second
# finds an exited peer about a second after the round stalls.
PROBE_INTERVAL_S = 0.5
# A live waiting peer pings this many times per timeout, so a few pings delayed by
# scheduling or the GIL never add up to a false verdict...
PINGS_PER_TIMEOUT = 8
# ...within these bounds: not more than 4 per second (P-1 messages each), not so
# rarely that a short test timeout is missed.
MIN_PING_S, MAX_PING_S = 0.25, 2.0



def patient_tick_s(idle_tick_s: float, cycle_ms: float) -> float:
    """How long an idle engine sleeps between rounds while the world is the only
    process set (waiting.IdleTicks): its transport's tick, or one cycle if longer."""
    return max(idle_tick_s, cycle_ms / 1000.0)


class RoundAbandoned(Exception):
    """Unwinds the engine thread out of a round that can never complete; the engine
    has already failed everything with PeerLostError."""


@dataclasses.dataclass(frozen=True)
class Loss:
    peer: Peer
    how: str            # EXITED, or the process state of a silent peer
    silent_for: float


def ping_interval(timeout: float) -> float:
    if timeout <= 0:
        return MAX_PING_S
    return min(max(timeout / PINGS_PER_TIMEOUT, MIN_PING_S), MAX_PING_S)


class Monitor:
    """Per-wait bookkeeping and the verdict; times are passed in (testable)."""

    def __init__(self, me: int, peers: Sequence[Peer], timeout: float, *, idle_tick_s: float,
                 probe: Callable[[Peer], str] = process_state) -> None:
        self.me = me
        self.timeout = timeout
        self.overdue_s = OVERDUE_TICKS * idle_tick_s
        self.peers = [p for p in peers if p.rank != me]
        domain = peers[me].domain
        self.local = [p for p in self.peers if domain is not None and p.domain == domain]
        self._probe = probe
        self._interval = ping_interval(timeout)
        self._wait: Optional[float] = None
        self._heard: dict[int, float] = {}
        self._states: dict[int, str] = {}
        self._next_ping = self._next_probe = 0.0

    def overdue(self, started: float, now: float) -> bool:
        """True once the wait that began at ``started`` is overdue; a new wait
        forgets the previous one's pings and process states."""
        if now - started < self.overdue_s:
            return False
        if self._wait != started:
            self._wait = started
            self._heard.clear()
            self._states.clear()
            self._next_ping = self._next_probe = now
        return True

    def heard(self, rank: int, now: float) -> None:
        self._heard[rank] = now

    def ping_due(self, now: float) -> bool:
        if now < self._next_ping:
            return False
        self._next_ping = now + self._interval
        return True

    def assess(self, now: float) -> list[Loss]:
        """Peers to declare lost now (call only while overdue)."""
        assert self._wait is not None
        if now >= self._next_probe:
            self._next_probe = now + PROBE_INTERVAL_S
            self._states = {p.rank: self._probe(p) for p in self.local}
        losses = []
        for peer in self.peers:
            state = self._states.get(peer.rank, UNKNOWN)
            silent = now - max(self._wait, self._heard.get(peer.rank, self._wait))
            if state == EXITED or (self.timeout > 0 and silent > self.timeout):
                losses.append(Loss(peer, state, silent))
        return losses

    def survivors(self, losses: Sequence[Loss]) -> list[int]:
        lost = {loss.peer.rank for loss in losses}
        return [p.rank for p in self.peers if p.rank not in lost]


_SILENT_DETAIL = {
    STOPPED: "its process is stopped: SIGSTOP, Ctrl-Z or a debugger",
    RUNNING: "its process still runs, but its hvdlite engine does not: code holding the "
             "GIL, a deadlock, or a collective far longer than the others",
    UNKNOWN: "its process is not visible from here: it may have exited or frozen, or "
             "its host or the network is down",
}


def describe(losses: Sequence[Loss]) -> str:
    """One clause per lost peer, e.g. 'rank 3 (pid 812 on node2) exited'."""
    clauses = []
    for loss in sorted(losses, key=lambda loss: loss.peer.rank):
        who = f"rank {loss.peer.rank} (pid {loss.peer.pid} on {loss.peer.host})"
        if loss.how == EXITED:
            clauses.append(f"{who} exited")
        else:
            clauses.append(f"{who} stopped answering for {loss.silent_for:.1f} s "
                           f"({_SILENT_DETAIL[loss.how]})")
    return "; ".join(clauses)


def error_message(me: int, what: str, reporter: Optional[int], timeout: float) -> str:
    source = "" if reporter is None else f" (detected by rank {reporter})"
    return (f"rank {me}: lost a peer: {what}{source}. No collective can complete without "
            "every rank, so this and every later hvdlite collective fails, and the job "
            "ends with a non-zero status. Look at that rank's own output first: its "
            "traceback, exit status, or a kill by the OOM killer (dmesg) or the batch "
            "system; a live but stuck process can be inspected with `py-spy dump --pid "
            f"PID`. HVDLITE_PEER_TIMEOUT={timeout:g} s sets how long a silent rank is "
            "waited for.")


class Liveness:
    """The engine's handle: one identity exchange at init (``peers``, which the engine's
    sentinel watches while inside a data collective: sentinel.py), then check() while
    waiting on a round."""

    def __init__(self, world: Transport, config: Any) -> None:
        self.me = world.rank
        self.timeout = config.peer_timeout
        peers = world.allgather(identity(self.me))
        self.peers = peers
        # The tick as at set-up: a cycle the autotuner lengthens later (five times
        # at most) stays far below HVDLITE_PEER_TIMEOUT, so it costs pings, never a
        # false verdict.
        tick = patient_tick_s(world.idle_tick_s, config.cycle_time)
        self.monitor = Monitor(self.me, peers, self.timeout, idle_tick_s=tick)
        self.channel = world.liveness_channel()

    def check(self, started: float, now: float) -> Optional[str]:
        """The PeerLostError message once a peer is lost (found here or reported by
        another rank), else None. Call every tick of a wait that began at ``started``."""
        heard, verdicts = self.channel.drain()
        for rank in heard:
            self.monitor.heard(rank, now)
        if verdicts:
            reporter, what = verdicts[0]
            return error_message(self.me, what, reporter, self.timeout)
        if not self.monitor.overdue(started, now):
            return None
        if self.monitor.ping_due(now):
            self.channel.ping([p.rank for p in self.monitor.peers])
        losses = self.monitor.assess(now)
        if not losses:
            return None
        what = describe(losses)
        self.channel.tell(self.monitor.survivors(losses), what)
        return error_message(self.me, what, None, self.timeout)
