"""How the engine thread waits inside a data collective: never blocked for good, so that
a peer that stops answering there is found as in a negotiation round.

A backend's blocking call (MPI_Allreduce, MPI_Wait, a Gloo work's wait) would hold the
engine thread until the collective completes, and a frozen peer (SIGSTOP, a debugger,
code holding the GIL) never lets it complete: every other rank hung. So the host
backends start their collectives without blocking and wait here. On the engine's
thread, which ``watch`` marks at set-up, a wait that lasts runs the engine's tick every
``every_s`` (the stall inspector and the liveness check: hvdlite/failure/liveness.py), as
its wait on a negotiation round does: once the wait is overdue the tick pings the
peers, declares lost those silent past HVDLITE_PEER_TIMEOUT, and raises to abandon the
collective. Peers waiting in the same collective ping too, so only the silent one is
named. Waits that complete before the first tick pay for one clock read: the steady
state never runs the check. On any other thread (tests, tools) nothing watches, and
the waits block as the library's own calls do.

The engine's transport is still touched by the engine's thread only: the tick runs on
the thread that waits.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable, Optional, Sequence

Tick = Callable[[float, float], None]    # (when the wait began, now); raises to give up

# Unwatched, a blocked wait is waited on in slices this long: the operation's own
# failure (a timeout of its library) still ends it.
_UNWATCHED_SLICE_S = 3600.0

_local = threading.local()


def watch(tick: Optional[Tick], every_s: float = 0.1) -> None:
    """Run ``tick`` every ``every_s`` while a wait of this thread lasts (None: stop)."""
    _local.watch = None if tick is None else (tick, every_s)


def _watched() -> Optional[tuple[Tick, float]]:
    return getattr(_local, "watch", None)


def wait_all(requests: Sequence[Any]) -> None:
    """Until every request (an MPI request: ``Test``, ``Wait``) has completed. MPI makes
    progress inside ``Test`` as inside a blocking wait. Between polls the thread yields
    its core: where ranks outnumber cores, the peer a collective waits for may be the
    one sharing it, and each round of the collective's schedule waited for that peer's
    turn on the core (a 7.5 MB Iallreduce at np=4 on 2 cores: 21 ms polled without
    yielding, 4.0 ms yielding, against 4.2 ms for the blocking Allreduce). With a core
    to itself, the yield returns at once."""
    watched = _watched()
    if watched is None:
        for request in requests:
            request.Wait()
        return
    left = [r for r in requests if not r.Test()]
    if not left:
        return
    tick, every_s = watched
    started = time.monotonic()
    next_tick = started + every_s
    while True:
        os.sched_yield()            # releases the GIL, as each Test does
        left = [r for r in left if not r.Test()]
        if not left:
            return
        now = time.monotonic()
        if now >= next_tick:
            tick(started, now)
            next_tick = now + every_s


def wait_blocked(requests: Sequence[Any], tick: Optional[Tick] = None,
                 every_s: Optional[float] = None) -> None:
    """Until every request (transport.BlockingPending: ``wait_for``) has completed, asleep
    in each, waking every ``every_s`` for ``tick`` (by default this thread's watch)."""
    if tick is None:
        watched = _watched()
        if watched is None:
            for request in requests:
                while not request.wait_for(_UNWATCHED_SLICE_S):
                    pass
            return
        tick, every_s = watched
    assert every_s is not None
    started = time.monotonic()
    next_tick = started + every_s
    for request in requests:
        while not request.wait_for(next_tick - time.monotonic()):
            now = time.monotonic()
            if now >= next_tick:
                tick(started, now)
                next_tick = now + every_s


def tick_if_watched(started: float, now: float) -> None:
    """For a wait loop of its own (the node's shared memory): run this thread's tick, if
    any, for a wait that began at ``started``; call it every ``every_s`` or so."""
    watched = _watched()
    if watched is not None:
        watched[0](started, now)
