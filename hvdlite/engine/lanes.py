"""The engine's lanes (hvdlite/engine/lane.py): the table of lanes a rank holds, and
how the engine serves them. ``OnLanes`` is inherited by ``Engine``, as ``Stoppable``
is, for the same reason: its methods share the engine's state with the hot path.

Between rounds the engine starts what the reducers queued and completes what is done
(``_serve_lanes``). While lanes are busy and nothing else is to do, it serves them
alone (``serve_lanes_until``), for at most one idle tick before a round, as an idle
rank joins one now and then: spinning while a user thread waits on a result,
otherwise in growing pauses that a submission ends, leaving the core to training
while the peers catch up.
"""
from __future__ import annotations

import collections
import time
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import numpy as np

from hvdlite.backends.base import Traffic
from hvdlite.engine.lane import CHANNEL_METHODS, CHECK_WORDS, Lane, LaneKind, LaneOp
from hvdlite.errors import HvdliteError, ShutdownError, StallError
from hvdlite.failure import waiting
from hvdlite.transport.base import LaneChannel

if TYPE_CHECKING:    # annotations only: the engine builds these objects
    import threading

    from hvdlite.engine.handles import HandleTable
    from hvdlite.failure.waiting import Doorbell, IdleTicks
    from hvdlite.negotiation.process_sets import ProcessSetRegistry, SetState
    from hvdlite.negotiation.requests import Descriptor
    from hvdlite.recording.recorder import PeerWaitClock
    from hvdlite.transport.base import Transport


_OP_NAMES = {LaneKind.SUM: "allreduce", LaneKind.REDUCE_SCATTER: "reducescatter",
             LaneKind.ALLGATHER: "allgather"}


class Lanes:
    """The engine's lanes, by id; everything here runs on the engine's thread except
    ``submit`` (user threads), which appends to a lane's deque (atomic under the GIL).
    Its ``traffic`` counts what the lanes sent as a backend's does: an estimate, the
    bytes of a bandwidth-optimal allreduce (hvdlite/backends/mpi.py)."""
    name = "lane"

    def __init__(self, complete: Callable[[int, Any], None],
                 fail: Callable[[int, BaseException], None],
                 reduced: Callable[[int, int], None]) -> None:
        self.traffic = Traffic(exact=False)
        self._reduced = reduced
        self._lanes: dict[int, Lane] = {}
        self._closing: collections.deque[int] = collections.deque()   # any thread appends
        self._opened: dict[int, int] = {}      # lanes opened so far, by process set
        self._next = 1
        self._complete, self._fail = complete, fail

    def open(self, name: str, set_id: int, channel: LaneChannel, rank: int, size: int,
             counts: Sequence[int], dtype: np.dtype, kind: LaneKind = LaneKind.SUM,
             segments: Sequence[Sequence[int]] = ()) -> Optional[int]:
        """A new lane: its id is this rank's own; its ``key`` is alike on every rank of
        the set (the requests that open lanes on a set are agreed in one order). None,
        the channel closed, where the transport has no collective of this kind on its
        lanes (the same transport on every rank: alike everywhere)."""
        if self._closing:
            self._close_marked()
        if not hasattr(channel, CHANNEL_METHODS[kind]):
            channel.close()
            return None
        lane_id, self._next = self._next, self._next + 1
        key = (set_id, self._opened.get(set_id, 0))
        self._opened[set_id] = key[1] + 1
        self._lanes[lane_id] = Lane(name, key, channel, rank, size, counts, dtype, kind,
                                    segments)
        return lane_id

    def close(self, lane_id: int) -> None:
        """Its owner is gone here (any thread): from the engine's next turn, this rank
        stands in on the lane with zeros counted as closed, and every rank frees it
        after the sum where all had closed it (hvdlite/engine/lane.py)."""
        self._closing.append(lane_id)

    def close_all(self) -> None:
        """Every lane closed, as at a shutdown that every rank reaches."""
        self._closing.extend(self._lanes)

    @property
    def closed(self) -> bool:
        """Whether a lane closed here waits for the others' closing (the engine then
        serves its lanes with each round) or is about to."""
        return bool(self._closing) or any(lane.closed for lane in self._lanes.values())

    @property
    def held(self) -> int:
        """The lanes not yet freed here."""
        return len(self._lanes)

    def submit(self, lane_id: int, op: LaneOp) -> bool:
        """Whether the lane took ``op``: a lane closes while its owner lives only at
        a shutdown, which every rank closes all lanes for."""
        lane = self._lanes.get(lane_id)
        if lane is None or lane.closed:
            return False
        lane.queued.append(op)
        return True

    @property
    def busy(self) -> bool:
        return any(lane.busy for lane in self._lanes.values())

    def counts(self) -> dict[tuple[int, int], int]:
        """Each lane's collectives finished here so far, by key (alike on every rank)."""
        return {lane.key: lane.started - len(lane.running) for lane in self._lanes.values()}

    def behind(self, counts: dict[tuple[int, int], int]) -> bool:
        """Whether a collective started here is among the first ``counts`` of its lane."""
        return any(lane.running and lane.running[0].position < counts.get(lane.key, 0)
                   for lane in self._lanes.values())

    @property
    def queued(self) -> bool:
        return any(lane.queued for lane in self._lanes.values())

    def serve(self, now: float, joined: bool) -> int:
        """Start what is queued, join in for a joined rank, and complete what is done;
        the number of handles completed or failed."""
        completed = 0
        if self._closing:
            self._close_marked()
        for lane_id, lane in list(self._lanes.items()):
            lane.start_queued(now)
            if lane.closed:
                lane.close_in(now)
            elif joined:
                lane.join_in(now)
            elif lane.joined_done and not lane.running:
                lane.joined_done = False      # the join is over: the next one counts
            completed += self._finish(lane_id, lane)
        return completed

    def _finish(self, lane_id: int, lane: Lane) -> int:
        """Complete or fail what is done on ``lane``, and free it after its last sum;
        how many handles that was."""
        done = lane.finished()
        for op, error in done:
            self._count(lane, op)
            if error is None:
                self._complete(op.handle, None)
            else:
                self._fail(op.handle, error)
        if lane.freed:
            del self._lanes[lane_id]
            lane.channel.close()
        return len(done)

    def _count(self, lane: Lane, op: LaneOp) -> None:
        """The bytes a bandwidth-optimal algorithm sends (an allreduce: a reduce-scatter
        and an allgather), and what the report's forecast reads as reduced: the
        gradients and their flags."""
        whole = op.buf.nbytes if lane.kind is not LaneKind.ALLGATHER else op.out.nbytes
        estimate = whole * (lane.size - 1) // lane.size
        if lane.kind is LaneKind.SUM:
            estimate *= 2
        self.traffic.add(_OP_NAMES[lane.kind], estimate, estimate)
        if lane.kind is not LaneKind.ALLGATHER:
            self._reduced(1, whole - CHECK_WORDS * op.buf.itemsize)   # one request

    def _close_marked(self) -> None:
        while self._closing:
            lane = self._lanes.get(self._closing.popleft())
            if lane is not None:
                lane.closed = True

    def pending(self, waited: set[int]) -> list[tuple[int, str, str, bool]]:
        """What the deadlock check lists: (set, bucket, its collective, whether a user
        thread waits on it), for every one started or queued."""
        return [(lane.set_id, op.name, _OP_NAMES[lane.kind], op.handle in waited)
                for lane in self._lanes.values()
                for op in list(lane.running) + list(lane.queued) if not op.is_stand_in]

    def abandon(self, error: HvdliteError, allgather: Callable[[Any], list[Any]]) -> None:
        """A deadlock verdict, on every rank at the same point: fail every sum started
        or queued, and bring every lane to the same count of sums on every rank (one
        ``allgather`` of the counts over the world), this rank standing in with zeros
        for the sums it never started, so the next step's buckets pair up again."""
        for lane in self._lanes.values():
            for op in list(lane.running) + list(lane.queued):
                if op.handle >= 0:
                    self._fail(op.handle, type(error)(str(error)))
            lane.queued.clear()
        self.square_up(allgather)

    def square_up(self, allgather: Callable[[Any], list[Any]], settle_s: float = 60.0) -> None:
        """Bring every lane to the same count of sums on every rank (collective over
        the world, at a point every rank reaches alike: a join's end, a deadlock's
        verdict), standing in with zeros for the sums this rank never started: a
        joined rank whose last zeros the join's end overtook, a rank that never
        reached a bucket others wait in.

        The counts are of collectives posted on each channel, void ones included: a
        void sum that one rank has seen end and another has not yet tested counts
        alike on both. Every one posted then has its partners, so each is waited for
        here, before any new one is numbered: each lane then counts the same sums on
        every rank (at most ``settle_s``; a peer that never comes is the stall
        check's)."""
        now = time.monotonic()
        counts = allgather({lane.key: lane.posted for lane in self._lanes.values()})
        for lane in self._lanes.values():
            most = max(theirs.get(lane.key, 0) for theirs in counts)
            while lane.posted < most:
                lane.stand_in(now)
        until = now + settle_s
        while any(lane.running for lane in self._lanes.values()) and time.monotonic() < until:
            for lane_id, lane in list(self._lanes.items()):
                self._finish(lane_id, lane)

    def stalls(self, now: float, check_s: float, shutdown_s: float) -> Optional[StallError]:
        for lane in self._lanes.values():
            message = lane.stalled(now, check_s, shutdown_s)
            if message is not None:
                return StallError(message)
        return None


def shared_counts(counts: Sequence[Optional[dict]]) -> dict:
    """By lane key, the fewest collectives any of ``counts`` finished (none: 0)."""
    if not counts or any(each is None for each in counts):
        return {}
    keys = set.intersection(*(set(each) for each in counts))
    return {key: min(each[key] for each in counts) for key in keys}


def serve_lanes_until(engine: OnLanes, deadline: float) -> None:
    """Serve the engine's lanes until none is busy, other work arrives, or ``deadline``
    (then a round, as an idle rank joins one now and then). As a round is waited on
    (hvdlite/failure/waiting.py): while a user thread is blocked on a result, spinning
    for HVDLITE_SPIN_TIME after each completion; otherwise, and after that, in growing
    pauses that a submission ends, leaving the core to training (4 ranks on 2 cores:
    spinning until done took the transformer's engine 83 ms of CPU a step, against
    68 ms in negotiation rounds)."""
    lanes, handles, doorbell = engine.lanes, engine.handles, engine._doorbell
    pause = waiting.FIRST_PAUSE_S
    longest = waiting.longest_pause(engine.config.cycle_time)
    spin_s = engine.config.spin_time * 1e-6
    spin_until = time.monotonic() + spin_s

    def ready() -> bool:
        return lanes.queued or engine._has_work()
    while True:
        if engine._serve_lanes():
            handles.notify()
            pause, spin_until = waiting.FIRST_PAUSE_S, time.monotonic() + spin_s
        if not lanes.busy or engine._has_work() or engine.dead is not None:
            return
        now = time.monotonic()
        if now >= deadline:
            return
        if handles.waiting and now < spin_until:
            continue
        if doorbell.listen(pause, ready):
            pause = waiting.FIRST_PAUSE_S
        else:
            pause = min(pause * 2, longest)


class OnLanes:
    """The engine's side of its lanes. The attributes below are the engine's own."""

    config: Any
    transport: Transport
    handles: HandleTable
    registry: ProcessSetRegistry
    dead: Optional[HvdliteError]
    peer_wait: Optional[PeerWaitClock]
    lanes: Lanes
    _submit_lock: threading.Lock
    _doorbell: Doorbell
    _idle: IdleTicks
    # Methods it calls: the engine's _has_work, Stoppable's raise_if_dead and _stop.

    # -- user-thread side -----------------------------------------------------------
    def submit_lane(self, lane_id: int, op: LaneOp) -> int:
        """Queue a bucket's sum on its lane (hvdlite/engine/lane.py); returns its handle."""
        with self._submit_lock:
            if self.dead is not None:
                self.raise_if_dead()
            op.handle = self.handles.create(None)
            if not self.lanes.submit(lane_id, op):
                self.handles.fail(op.handle, ShutdownError(
                    f"rank {self.transport.rank}: hvdlite is shutting down, and its "
                    f"lanes are closed: bucket '{op.name}' was not reduced"))
        self._doorbell.ring()
        return op.handle

    def close_lane(self, lane_id: int) -> None:
        """Its reducer is gone (any thread): the lane is freed once idle."""
        self.lanes.close(lane_id)

    # -- engine thread ---------------------------------------------------------------
    def _open_lane(self, state: SetState, desc: Descriptor) -> Optional[int]:
        """An agreed request to open a lane, run at the same point on every rank of
        the set: its id here, or None where the set's transport has no lane of its
        kind."""
        channel = state.comm.lane_channel()
        if channel is None:
            return None
        size = state.comm.size
        segments = [desc.splits[i:i + size] for i in range(0, len(desc.splits or ()), size)]
        return self.lanes.open(desc.name, state.set_id, channel, state.comm.rank, size,
                               desc.shape, np.dtype(desc.dtype),
                               LaneKind(dict(desc.settings).get("kind", 0)), segments)

    def _wait_for_work(self) -> None:
        """Until there is work for a round, or an idle rank's tick has passed; the
        lanes are served meanwhile, a tick at most before a round."""
        deadline = None
        while not self._has_work():
            if self.lanes.busy:
                now = time.monotonic()
                deadline = deadline or now + self.transport.idle_tick_s
                if now >= deadline:
                    return
                serve_lanes_until(self, deadline)
                continue
            # (a round with work resets the schedule: below)
            self._idle.sleep(self.config.cycle_time, self._doorbell, self._has_work_or_lanes,
                             patient=self.registry.only_world())
            if not self.lanes.busy:
                return

    def _serve_lanes_in_round(self) -> bool:
        """While a round is waited on: serve the lanes if busy; whether they are."""
        lanes = self.lanes
        if not lanes.busy:
            return False
        if self._serve_lanes():
            self.handles.notify()
        return lanes.busy

    def _finish_lanes(self, counts: dict[tuple[int, int], int]) -> None:
        """Ranks shut down, each once its own collectives on the lanes were done: those
        complete here too, with no part of theirs still to come, so they are served to
        the end rather than failed (a script whose last step's allgather is still
        under way here when rank 0 exits). Then every rank closes every lane, and
        frees each after the sum where all closed it: no collective is left pending
        on a lane's channel when the transport finalizes. HVDLITE_STALL_CHECK_TIME
        bounds the wait."""
        until = time.monotonic() + max(self.config.stall_check_time, 1.0)
        lanes = self.lanes
        while lanes.behind(counts) and time.monotonic() < until:
            self._serve_or_pause()
        lanes.close_all()
        while lanes.held and time.monotonic() < until:
            self._serve_or_pause()

    def _serve_or_pause(self) -> None:
        if self._serve_lanes():
            self.handles.notify()
        else:
            time.sleep(waiting.FIRST_PAUSE_S)

    def _has_work_or_lanes(self) -> bool:
        return self._has_work() or self.lanes.queued

    def _serve_lanes(self) -> int:
        """Start, join in, complete (engine thread); stalls stop the engine. With
        HVDLITE_REPORT, a bucket's time on its lane counts as time waiting for the
        peers, as a negotiated request's time before agreement does."""
        now = time.monotonic()
        clock, lanes = self.peer_wait, self.lanes
        if clock is not None and lanes.busy:
            clock.submitted(now)
        served = lanes.serve(now, self.registry.in_join())
        if (clock is not None and clock.since is not None and not lanes.busy
                and not any(s.pending for s in self.registry.members())):
            clock.settled(time.monotonic())
        stalled = self.lanes.stalls(now, self.config.stall_check_time,
                                    self.config.stall_shutdown_time)
        if stalled is not None:
            self._stop(stalled)
        return served
