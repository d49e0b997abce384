"""A peer lost while this rank's engine is blocked inside a data collective with it.

liveness.py looks for lost peers while the engine waits on a negotiation round, and
inside the host backends' data collectives (hvdlite/transport/waits.py), once a wait is
overdue. A call that blocks for good (a GPU backend's, a library's) never comes back
to look, and a peer's death is worth reporting sooner than an overdue wait: under
hydra the job used to hang until the launcher acted, 30 s later
(HVDLITE_PEER_TIMEOUT + exit_guard.MARGIN_S).

The sentinel is a thread asleep in poll() on a pidfd per peer on this host: the
kernel wakes it the moment a peer's process ends, and nothing runs while every
peer lives. Once a peer has ended and the engine has been inside a collective of
a process set holding that peer for GRACE_S since both, it does what the engine
does on a loss (the engine thread stays stuck in MPI): it says so in one line,
which under hydra ends the job (exit_guard.py), and fails every pending and later
collective with PeerLostError naming the peer. The grace lets a collective
complete that the peer finished just before it ended.
"""
from __future__ import annotations

import os
import select
import threading
import time
from typing import Callable, Optional, Sequence

from hvdlite.failure.liveness import (EXITED, PROBE_INTERVAL_S, TICK_S, Loss, Peer, describe,
                                      error_message, process_state)

# A collective that a peer completed before it ended completes here within
# milliseconds; one still running this long after the end cannot complete.
GRACE_S = 0.5
# An MPI error that a peer's death caused (its memory is gone) can arrive before its
# process has ended; the engine waits this long for the end before calling the
# error a bug.
ENDED_WAIT_S = 1.0

Inside = Optional[tuple[float, Sequence[int]]]   # (since, global ranks of the set)


def _pidfd(pid: Optional[int]) -> Optional[int]:
    """A pidfd for ``pid``, or None (no pid, an old kernel, another user's process)."""
    if not pid or not hasattr(os, "pidfd_open"):
        return None
    try:
        return os.pidfd_open(pid)
    except OSError:
        return None


class Sentinel:
    """Set ``inside`` (from the engine thread) while the engine runs a data collective;
    ``on_loss(message)`` runs on the sentinel's thread, once."""

    def __init__(self, me: int, peers: Sequence[Peer], timeout: float,
                 on_loss: Callable[[str], None],
                 probe: Callable[[Peer], str] = process_state) -> None:
        self.inside: Inside = None
        self._me, self._timeout, self._on_loss, self._probe = me, timeout, on_loss, probe
        domain = peers[me].domain
        self.local = [p for p in peers
                      if p.rank != me and domain is not None and p.domain == domain]
        self._watched: dict[int, Peer] = {}    # pidfd -> peer
        self._ended: dict[int, float] = {}     # rank -> when its end was seen
        self._wake: Optional[tuple[int, int]] = None
        self._thread: Optional[threading.Thread] = None

    # -- lifetime ----------------------------------------------------------------
    def start(self) -> None:
        if not self.local:
            return
        for peer in self.local:
            fd = _pidfd(peer.pid)
            if fd is not None:
                self._watched[fd] = peer
            if self._probe(peer) == EXITED:   # before the pidfd: gone, or its pid reused
                self._ended[peer.rank] = time.monotonic()
        self._wake = os.pipe()
        self._thread = threading.Thread(target=self._run, name="hvdlite-sentinel", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the thread (the engine stopped)."""
        if self._wake is not None:
            os.write(self._wake[1], b"x")
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
            if self._thread.is_alive():
                return        # still polling them: the fds go with the process
        for fd in [*self._watched, *(self._wake or ())]:
            os.close(fd)
        self._watched.clear()
        self._wake = None

    # -- what ended ----------------------------------------------------------------
    def ended_peers(self) -> list[Peer]:
        """The peers on this host whose process has ended, checked now."""
        return [p for p in self.local if self._probe(p) == EXITED]

    def explain(self, wait: float = ENDED_WAIT_S) -> Optional[str]:
        """The PeerLostError message if a peer on this host ends within ``wait`` s (an
        MPI error can be the first sign of a peer's death), else None."""
        deadline = time.monotonic() + wait
        while True:
            ended = self.ended_peers()
            if ended:
                return error_message(self._me, describe([Loss(p, EXITED, 0.0) for p in ended]),
                                     None, self._timeout)
            if time.monotonic() >= deadline:
                return None
            time.sleep(TICK_S / 2)

    def losses(self, now: float) -> list[Loss]:
        """Ended peers that the collective the engine is inside can no longer
        complete without (call from any thread)."""
        inside = self.inside
        if inside is None or not self._ended:
            return []
        since, ranks = inside
        return [Loss(p, EXITED, now - self._ended[p.rank]) for p in self.local
                if p.rank in self._ended and p.rank in ranks
                and now - max(since, self._ended[p.rank]) >= GRACE_S]

    # -- the thread ----------------------------------------------------------------
    def _run(self) -> None:
        assert self._wake is not None
        poller = select.poll()
        poller.register(self._wake[0], select.POLLIN)
        for fd in self._watched:
            poller.register(fd, select.POLLIN)
        unwatched = [p for p in self.local if p not in self._watched.values()]
        next_probe = 0.0
        while True:
            # Asleep until a peer ends, unless some peer has no pidfd (then probed) or
            # one has ended (then the engine is looked at every tick).
            timeout = None
            if self._ended:
                timeout = TICK_S
            elif unwatched:
                timeout = PROBE_INTERVAL_S
            events = poller.poll(None if timeout is None else timeout * 1000)
            now = time.monotonic()
            for fd, _ in events:
                if fd == self._wake[0]:
                    return
                poller.unregister(fd)
                self._ended.setdefault(self._watched[fd].rank, now)
            if unwatched and now >= next_probe:
                next_probe = now + PROBE_INTERVAL_S
                for peer in unwatched:
                    if self._probe(peer) == EXITED:
                        self._ended.setdefault(peer.rank, now)
            losses = self.losses(now)
            if losses:
                self._on_loss(error_message(self._me, describe(losses), None, self._timeout))
                return
