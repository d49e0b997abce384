"""How the engine waits for a negotiation round: the spin/sleep schedule, and the
liveness tick that runs while a wait lasts.

A waiting engine busy-polls only while someone waits on the result: a user
thread blocked in ``synchronize()``, or local work submitted during the wait
(the first gradient of a step). Otherwise it sleeps in growing pauses, leaving
the CPU to training, which on a core per rank would lose whatever a spinning
engine takes. Its pauses end early when a user thread rings the doorbell. Rounds
that can be waited on asleep (torch's Gloo, on threads of its own; the node's shared
memory, on a futex) it waits on blocked.
"""
from __future__ import annotations

import collections
import contextlib
import ctypes
import threading
import time
from typing import Any, Callable, Iterator, Sequence

from hvdlite.failure import liveness
from hvdlite.transport.base import BlockingPending, Pending

_PR_SET_TIMERSLACK = 29
# The wait schedule: spin in slices short enough to notice completion within a
# few microseconds, and sleep in pauses that start at 20 us (the latency of a
# wake-up on this kind of VM) and double up to a quarter of the idle cycle.
_SPIN_SLICE_S = 20e-6
FIRST_PAUSE_S = 20e-6
_LONGEST_PAUSE_FLOOR_S = 50e-6
# A round waited on blocked wakes this often while the engine's lanes are busy.
_SERVING_SLICE_S = 1e-3


def longest_pause(cycle_ms: float) -> float:
    """The longest pause between polls of a round (seconds): a quarter of the cycle."""
    return max(_LONGEST_PAUSE_FLOOR_S, cycle_ms * 1e-3 / 4)


def all_done(requests: Sequence[Pending]) -> bool:
    """Whether every request has completed, testing each in turn (the GIL is released
    in each test). Not ``Testall``: MPICH 5.0.2's reports an error for a persistent
    collective (a round started from ``Allreduce_init``) that ``Test`` completes
    correctly."""
    for request in requests:
        if not request.Test():
            return False
    return True


def precise_sleeps() -> None:
    """Linux pads every sleep of this thread by its timer slack (50 us by default),
    which made each short pause in a wait cost ~80 us. Ask for 1 us instead."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_TIMERSLACK, ctypes.c_ulong(1000), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: sleeps are merely less precise
        pass


class Doorbell:
    """How user threads wake a sleeping engine. It is rung only while the engine
    listens: most submissions arrive while the engine is busy and need no wake-up.
    The bell is a lock, held while unrung, that the engine sleeps on: a ring is
    one release, one futex wake-up (an Event's set and wait add a hand-off of its
    condition's lock: some 10-20 us more per wake-up on two cores)."""

    def __init__(self) -> None:
        self._bell = threading.Lock()
        self._bell.acquire()
        self.listening = False

    def ring(self) -> None:
        if self.listening:
            self.listening = False      # one wake-up per sleep: a burst of submissions
            self._release()             # (200 gradients) pays for one release, not 200

    def ring_always(self) -> None:
        self._release()

    def _release(self) -> None:
        try:
            self._bell.release()
        except RuntimeError:            # two threads rang at once: it is rung already
            pass

    def listen(self, timeout: float, ready: Callable[[], bool]) -> bool:
        """Sleep up to ``timeout`` seconds unless ``ready()`` or a ring; True if
        woken early. Order matters: listen, clear, then check, so a ring racing
        with this is either seen by ``ready()`` or releases the bell after the clear."""
        self.listening = True
        self._bell.acquire(blocking=False)      # clear a ring nobody slept through
        try:
            return ready() or self._bell.acquire(timeout=max(timeout, 0.0))
        finally:
            self.listening = False


class IdleTicks:
    """How long an idle engine sleeps before joining its next round (ranks must keep
    joining rounds so that shutdowns, stall reports and liveness get through).

    While the world is the only process set, nobody waits on an idle rank's rounds:
    every collective needs each rank's own submission, which wakes that rank at once
    (the doorbell), and a round it joins with nothing to submit agrees nothing. So it
    is ``patient``: it sleeps a whole tick, the transport's ``idle_tick_s`` (unless one
    cycle is longer), which liveness.OVERDUE_TICKS allows for. Ticking from one cycle,
    doubling while all were idle, cost four rounds in each step of the MLP at np=4 on
    2 cores, each ~80-280 us of CPU on every rank, taken from training (BENCHMARKS.md,
    "idle ranks tick slowly").

    With smaller process sets, a member with work on one of them waits for this rank's
    next global round (an iteration waits for the rounds of all its sets): one cycle
    while any rank of its sets has work; once every rank is idle, twice as long each
    round, up to 64 cycles and 0.1 s, whatever the transport's tick: that wait is a
    peer's latency."""

    MAX_DOUBLINGS = 6
    LONGEST_BACKOFF_S = 0.1       # unless one cycle is longer

    def __init__(self, tick_s: float) -> None:
        self._tick_s = tick_s
        self._doublings = 0

    def busy(self) -> None:
        """Some rank has work: the next sleep that is not patient is one cycle."""
        self._doublings = 0

    def sleep(self, cycle_ms: float, doorbell: Doorbell, ready: Callable[[], bool], *,
              patient: bool) -> None:
        """Sleep until the next tick, a ring, or ``ready()``."""
        if patient:
            doorbell.listen(liveness.patient_tick_s(self._tick_s, cycle_ms), ready)
            return
        cycle = cycle_ms / 1000.0
        backoff = 1 << min(self._doublings, self.MAX_DOUBLINGS)
        self._doublings += 1
        longest = max(cycle, self.LONGEST_BACKOFF_S)
        doorbell.listen(min(cycle * backoff, longest), ready)


class Batches:
    """Per-thread batches of submissions. A thread inside ``batch()`` queues its
    requests when it leaves, all at once, and rings once: the engine then sees a
    bucket of gradients in one round and reduces it as one fused buffer, where
    submissions one by one would each wake it and run in rounds of a few."""

    def __init__(self, queue: collections.deque, doorbell: Doorbell) -> None:
        self._queue = queue
        self._doorbell = doorbell
        self._local = threading.local()
        # Batches open on any thread: while none is, put() skips the thread-local
        # lookup (some 5-10 us on a lone op after idle). Changed under the lock.
        self._open = 0
        self._open_lock = threading.Lock()

    def put(self, request: Any) -> bool:
        """Queue ``request`` now, or hold it for this thread's batch; True if queued
        (the caller rings the doorbell)."""
        if not self._open:
            self._queue.append(request)
            return True
        held = getattr(self._local, "held", None)
        if held is None:
            self._queue.append(request)
            return True
        held.append(request)
        return False

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        if getattr(self._local, "held", None) is not None:
            yield                               # nested: the outer batch queues
            return
        self._local.held = []
        with self._open_lock:
            self._open += 1
        try:
            yield
        finally:
            with self._open_lock:
                self._open -= 1
            held, self._local.held = self._local.held, None
            if held:
                self._queue.extend(held)        # one C call: the engine sees all or none
                self._doorbell.ring()


class RoundWaiter:
    """Waits on a transport's pending operations; ``on_tick(started, now)`` runs every
    liveness.TICK_S once a wait has lasted (the stall inspector, the check for a lost peer)."""

    def __init__(self, config: Any, handles: Any, on_tick: Callable[[float, float], None],
                 doorbell: Doorbell, queued: Callable[[], int],
                 serve: Callable[[], bool] = lambda: False) -> None:
        self.config = config      # replaced by a negotiated reconfiguration
        self._handles = handles
        self._on_tick = on_tick
        self._doorbell = doorbell
        self._queued = queued      # how many local requests wait for the next round
        # The engine's lanes, served while a round lasts (a peer may wait on a bucket
        # queued here meanwhile); True while they are busy.
        self._serve = serve

    def wait(self, requests: Sequence[Pending]) -> None:
        """Poll until every round completes, sleeping in growing pauses. While a user
        thread is blocked in synchronize(), or once local work arrives (a pause ends
        at its ring), the engine busy-polls instead (testing releases the GIL), for up
        to HVDLITE_SPIN_TIME per round: that is latency someone is waiting on; an idle
        round a peer has not joined yet then completes the moment the peer does.
        Otherwise the CPU belongs to the training thread, which on a core per rank
        would lose whatever a spinning engine takes.
        A wait that lasts runs on_tick every liveness.TICK_S: the stall
        inspector, and the check that fails everything if a peer is gone.
        Requests that all have ``wait_for`` (BlockingPending) are waited on blocked
        instead, with the same ticks."""
        requests = list(requests)
        if all(hasattr(request, "wait_for") for request in requests):
            self._block(requests)
            return
        budget = self.config.spin_time * 1e-6
        pause = FIRST_PAUSE_S
        longest = longest_pause(self.config.cycle_time)
        started = next_tick = 0.0
        urgent = False
        queued_before = self._queued()

        def new_local_work() -> bool:
            return self._queued() > queued_before
        while not all_done(requests):
            self._serve()
            if (urgent or self._handles.waiting) and budget > 0:
                start = time.perf_counter()
                while time.perf_counter() - start < _SPIN_SLICE_S:
                    if all_done(requests):
                        return
                budget -= time.perf_counter() - start
                continue
            if urgent:              # rung once already: pauses are plain sleeps again
                time.sleep(pause)
            elif self._doorbell.listen(pause, new_local_work):
                urgent = True
                continue
            if pause < longest:
                pause = min(pause * 2, longest)
                continue
            # Only a wait that reached the longest pause (about 0.3 ms in) reads the
            # clock: rounds that complete sooner pay nothing for what follows.
            now = time.monotonic()
            if not started:
                started, next_tick = now, now + liveness.TICK_S
            elif now >= next_tick:
                self._on_tick(started, now)
                next_tick = now + liveness.TICK_S

    def _block(self, requests: Sequence[BlockingPending]) -> None:
        """Wait blocked on each request in turn, waking every liveness.TICK_S for
        on_tick. Polled instead, a Gloo round cost its waiter a wake-up every 250 us:
        ~200 a round of the transformer at np=4 on 2 cores, whose rounds wait ~0.1 s
        for ranks still in their backward pass (BENCHMARKS.md, "rounds on Gloo wait
        blocked")."""
        started = time.monotonic()
        next_tick = started + liveness.TICK_S
        for request in requests:
            while not request.wait_for(min(next_tick - time.monotonic(),
                                           _SERVING_SLICE_S if self._serve() else 1e9)):
                now = time.monotonic()
                if now >= next_tick:
                    self._on_tick(started, now)
                    next_tick = now + liveness.TICK_S
