"""The background engine: the one thread that talks to the transport (MPI: mpi_transport.py).

User threads only enqueue Requests and wait on handles. Each engine iteration:

1. wait until local work arrives or HVDLITE_CYCLE_TIME passes (idle ranks must
   still join rounds so that a peer's shutdown or stall report gets through);
2. start one negotiation round per process set: a non-blocking bitwise-AND
   allreduce of [flags | one bit per cached response this rank has a matching
   request for]. While every rank's requests are cached (steady-state training)
   this is the whole negotiation: the bits set everywhere are agreed;
3. if any rank needs more (an uncached or changed tensor, a join, a shutdown,
   a stall report), all ranks fall through to a full round: gather every
   pending descriptor on the set's rank 0, which validates and broadcasts the
   responses;
4. run the agreed responses in the same order on every rank.

How it stops (a shutdown, an agreed stall, a lost peer, a crash) is in stopping.py,
which ``Engine`` inherits.
"""
from __future__ import annotations

import array
import collections
import os
import threading
import time
from typing import Any, Optional, Sequence

from hvdlite.backends import registry as backends_registry
from hvdlite.config import sources as config_sources
from hvdlite.engine.executor import Executor
from hvdlite.engine.handles import HandleTable
from hvdlite.engine.lanes import Lanes, OnLanes, shared_counts
from hvdlite.engine.stopping import Stoppable
from hvdlite.errors import (DeadlockError, DuplicateNameError, HvdliteError, ShutdownError,
                            StallError, error_class)
from hvdlite.failure import deadlock, exit_guard, liveness, stall, waiting
from hvdlite.failure.sentinel import Sentinel
from hvdlite.negotiation.coordinator import Report, Verdict
from hvdlite.negotiation.process_sets import (GLOBAL_SET_ID, NO_FULL_ROUND, RANK_IDLE,
                                              ProcessSetRegistry, SetState, round_vector)
from hvdlite.negotiation.requests import CACHEABLE, Kind, Request, Response
from hvdlite.negotiation.set_agreement import RequestedSets, register_agreed_sets
from hvdlite.policy import defaults, settings_agreement
from hvdlite.recording import outputs
from hvdlite.recording.recorder import PeerWaitClock
from hvdlite.recording.timeline import Timeline
from hvdlite.transport import waits
from hvdlite.transport.base import Transport
from hvdlite.transport.topology import Topology, detect

_CONTROL = frozenset({Kind.ADD_PROCESS_SET, Kind.REMOVE_PROCESS_SET, Kind.RECONFIGURE,
                      Kind.OPEN_LANE})


class Engine(Stoppable, OnLanes):
    def __init__(self, config: Any, transport: Transport, process_sets: RequestedSets = ()) -> None:
        self.config = config
        self._initial_sets = process_sets      # registered at setup, once every rank agrees
        self.handles = HandleTable()
        self.topology: Optional[Topology] = None
        self.timeline: Optional[Timeline] = None
        self.transport = transport    # the world; each process set has its own (registry)
        # Submission: the user side appends to a deque (atomic under the GIL) and rings
        # the doorbell, which wakes the engine only if it sleeps; the two threads never
        # contend for a lock on the hot path.
        self._submit_lock = threading.Lock()   # user threads only
        self._queue: collections.deque[Request] = collections.deque()
        self._doorbell = waiting.Doorbell()
        self._batches = waiting.Batches(self._queue, self._doorbell)
        self.batch = self._batches.batch     # with engine.batch(): submissions go together
        self._idle = waiting.IdleTicks(transport.idle_tick_s)
        self._in_flight: dict[int, set[str]] = {}
        self._markers: dict[tuple[int, str], int] = {}   # (set, name) -> the marker's handle
        self.dead: Optional[HvdliteError] = None   # why it stopped; set once
        self.defaults_chosen: list[str] = []   # topology-aware defaults applied, and why
        self._shutdown_requested = False
        self._stall_messages: dict[int, str] = {}
        self._report_after = stall.report_after(config)   # read every round
        self._inspectors: dict[int, stall.StallInspector] = {}
        self._deadlock = deadlock.DeadlockWatch(self.handles, config, transport.rank == 0)
        self._setup_error: Optional[BaseException] = None
        self._ready = threading.Event()
        # HVDLITE_REPORT: time this rank's requests wait for agreement (engine thread).
        self.peer_wait = PeerWaitClock() if config.report else None
        self.executor = Executor(config, self.complete, lambda: self.timeline)
        self.lanes = Lanes(self.handles.complete, self.handles.fail, self.executor.reductions.add)
        self.executor.chain.also_counting(self.lanes)
        self.registry = ProcessSetRegistry(config.cache_capacity, self._open_set,
                                           self.executor.close_set)
        self._thread = threading.Thread(target=self._main, name="hvdlite-engine", daemon=True)

    # -- user-thread side -----------------------------------------------------------
    def start(self) -> Topology:
        self._thread.start()
        self._ready.wait()
        if isinstance(self._setup_error, HvdliteError):
            raise self._setup_error     # typed and worded for the user (a refused process set)
        if self._setup_error is not None:
            raise HvdliteError(f"hvdlite.init() failed: {self._setup_error!r}") from self._setup_error
        assert self.topology is not None
        return self.topology

    def submit(self, request: Request, finish: Any = None) -> int:
        """Queue a request and return its handle; raises before queueing on misuse.

        ``finish`` turns the result into what ``synchronize`` returns (a binding's
        tensor). An error marker (``request.desc.error``) only tells the other ranks,
        through negotiation, that this rank's call failed; nobody returns its handle.
        """
        if self._markers:
            self._await_marker(request.process_set_id, request.desc.name)
        with self._submit_lock:
            if self.dead is not None:
                self.raise_if_dead()
            names = self._in_flight.setdefault(request.process_set_id, set())
            if request.desc.name in names:
                raise DuplicateNameError(
                    f"rank {self.transport.rank}: a collective named '{request.desc.name}' "
                    "is already in flight; synchronize it before reusing the name, or "
                    "give each concurrent tensor its own name.")
            names.add(request.desc.name)
            request.handle = self.handles.create(finish)
            if request.desc.error:
                self._markers[(request.process_set_id, request.desc.name)] = request.handle
            queued = self._batches.put(request)
        if queued:
            self._doorbell.ring()
        return request.handle

    def _await_marker(self, set_id: int, name: str) -> None:
        """A name this rank just failed locally stays in flight until its error marker
        is resolved (every member rank reached it). Reusing the name, e.g. to retry
        with corrected arguments, waits for that rather than failing as a duplicate."""
        handle = self._markers.pop((set_id, name), None)
        if handle is not None:
            try:
                self.handles.wait(handle)
            except HvdliteError:
                pass        # the marker's own verdict: this rank already raised its error

    # -- engine thread ---------------------------------------------------------------
    def _main(self) -> None:
        try:
            self._setup()
        except BaseException as exc:  # reported to init() on the user thread
            self._setup_error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            while self._iteration():
                pass
        except BaseException as exc:
            self._crash(exc)
        finally:
            self._sentinel.stop()

    def _setup(self) -> None:
        waiting.precise_sleeps()
        self.topology = detect(self.transport)
        backends_registry.agree(self.transport)     # before any chain picks a backend
        # Before anything reads a setting that every rank must share (the output check's
        # HVDLITE_OUTPUT_CHECK among them): a difference is a ConfigError on every rank.
        everyone = defaults.agree(self.transport, self.config, config_sources())
        settings_agreement.check(everyone, self.transport.rank)
        mine = everyone[self.transport.rank]
        self.config, self.defaults_chosen = mine.config, list(mine.reasons)
        unusable = outputs.agree(self.transport, self.config)   # before anything is started
        self.executor.reconfigure(self.config)
        register_agreed_sets(self.registry, self.transport, self._initial_sets)
        self._liveness = liveness.Liveness(self.transport, self.config)
        self._sentinel = Sentinel(self._liveness.me, self._liveness.peers,
                                  self._liveness.timeout, self._lost)
        self._sentinel.start()
        self._waiter = waiting.RoundWaiter(self.config, self.handles, self._while_waiting,
                                           self._doorbell, lambda: len(self._queue),
                                           self._serve_lanes_in_round)
        self._stalls_told: set[int] = set()   # held stall errors already logged
        # Waits inside data collectives tick as a round's do (hvdlite/transport/waits.py).
        waits.watch(self._while_waiting, liveness.TICK_S)
        if self.config.exit_guard:
            exit_guard.spawn(os.environ, self.config.peer_timeout)
        if (self.config.timeline_path and self.topology.rank == 0
                and "HVDLITE_TIMELINE" not in unusable):
            self.timeline = Timeline(self.config.timeline_path,
                                     mark_cycles=self.config.timeline_mark_cycles)

    def _open_set(self, set_id: int, comm: Transport) -> None:
        self.executor.open_set(set_id, comm)
        ranks = self.registry.ranks_of(set_id) or ()
        self._inspectors[set_id] = stall.StallInspector(self.config, ranks)

    def _iteration(self) -> bool:
        self._wait_for_work()
        if (timeline := self.timeline) is not None:   # one read: stop_timeline() may clear it
            timeline.cycle_start()
        self._drain_queue()
        lanes = self.lanes     # before the round: a peer may wait on them
        if lanes.busy or lanes.closed or self.registry.in_join():
            self._serve_lanes()
        if self.executor.busy and self.executor.progress():
            self.handles.notify()      # finished by asynchronous backend work: before the round
        members = self.registry.members()
        idle = not self._has_work()
        vectors = [self._round_vector(s, idle) for s in members]
        requests = [s.round.start() for s in members]     # each over its vector
        self._waiter.wait(requests)
        self._deadlock.observe(vectors[0][0])      # members[0] is the global set
        if not idle or not all(v[0] & RANK_IDLE for v in vectors):
            self._idle.busy()     # a rank has work: with process sets, it may wait on us
        for state, vector in zip(members, vectors):
            if vector[0] & NO_FULL_ROUND:
                bits = state.cache.bits_of(vector, 1)
                self._dispatch(state, self._cached_responses(state, bits), cached=True,
                               plan_key=(state.set_id, tuple(bits)))
            elif not self._full_round(state):
                return False
        clock = self.peer_wait
        if (clock is not None and clock.since is not None and not self.lanes.busy
                and not any(s.pending for s in members)):
            clock.settled(time.monotonic())
        self._check_stalls()
        # Waiters wake last, just before this thread next blocks: a user thread woken
        # while the engine still runs Python sleeps again on the GIL until the engine
        # lets go, a second wake-up.
        self.handles.notify()
        return self.dead is None

    def _has_work(self) -> bool:
        if self._queue or self._shutdown_requested or self.executor.busy:
            return True
        for state in self.registry.members():
            if state.pending:
                return True
        return False

    def _drain_queue(self) -> None:
        queue = self._queue
        while queue:
            request = queue.popleft()
            state = self.registry.member(request.process_set_id)
            if state is None:
                self._fail(request, HvdliteError(
                    f"process set {request.process_set_id} was removed before "
                    f"'{request.desc.name}' ran"))
            else:
                state.pending[request.desc.name] = request
                if self.peer_wait is not None:
                    self.peer_wait.submitted(request.submitted_at)

    def _round_vector(self, state: SetState, idle: bool = False) -> array.array:
        if state.set_id != GLOBAL_SET_ID:   # a rank in join() says so in full rounds
            need_full = state.set_id in self._stall_messages or self.registry.in_join()
            return round_vector(state, need_full, self._report_after, idle)
        need_full = (GLOBAL_SET_ID in self._stall_messages or self._shutdown_requested
                     or self._deadlock.due)
        vector = round_vector(state, need_full, self._report_after, idle)
        vector[0] |= self._deadlock.flags(self.executor.busy)
        return vector

    def _while_waiting(self, started: float, now: float) -> None:
        """A round or a data collective has been incomplete for a tick: run what
        otherwise runs only between rounds (the stall inspector), and look for a peer
        that is gone (raises RoundAbandoned, which unwinds the wait)."""
        self._check_stalls()
        stall.tell_stuck(self._stall_messages, self._stalls_told)
        message = self._liveness.check(started, now)
        if message is not None:
            self._lost(message)
            raise liveness.RoundAbandoned(message)

    def _cached_responses(self, state: SetState, bits: list[int]) -> list[Response]:
        responses = [state.cache.response(b) for b in bits]
        if state.coordinator is not None and responses:
            state.coordinator.forget([r.name for r in responses])
        return responses

    def _full_round(self, state: SetState) -> bool:
        now = time.monotonic()
        on_global = state.set_id == GLOBAL_SET_ID
        shutting = self._shutdown_requested and on_global
        report = Report([(r.desc, now - r.submitted_at) for r in state.pending.values()],
                        shutting, not on_global and self.registry.in_join(),
                        self._deadlock.pending(self.registry.members(), self.lanes) if on_global
                        else None, self.lanes.counts() if shutting else None)
        gathered = state.comm.gather_awaited(report, self._waiter.wait)
        verdict = None
        if state.coordinator is not None:
            verdict = self._decide(state, gathered)
        verdict = state.comm.bcast_awaited(verdict, self._waiter.wait)
        self._dispatch(state, verdict.responses, cached=False)
        if verdict.shutdown_ranks:
            self._finish_lanes(verdict.finish)
            ranks = [state.ranks[r] for r in verdict.shutdown_ranks]
            self._stop(ShutdownError(
                f"hvdlite was shut down on rank(s) {ranks}; no further collectives can "
                "complete. Call hvdlite.shutdown() only once every rank is done."))
            return False
        if verdict.stall:
            self._stop(StallError(verdict.stall))
            return False
        if verdict.deadlock:    # every rank fails what it has pending; the engine goes on
            error = DeadlockError(f"rank {self.transport.rank}: {verdict.deadlock}")
            deadlock.fail_all(self.registry.members(), self.fail_set, error)
            self.lanes.abandon(error, self.transport.allgather)
        return True

    def _decide(self, state: SetState, gathered: list[Report]) -> Verdict:
        coordinator = state.coordinator
        for rank, report in enumerate(gathered):
            coordinator.ingest(rank, report.descs, joined=report.joined)
        responses = coordinator.responses()
        message = self._stall_messages.pop(state.set_id, "")
        shutdown = [r for r, report in enumerate(gathered) if report.shutdown]
        stuck = "" if state.set_id != GLOBAL_SET_ID else self._deadlock.judge(
            gathered, responses, self.registry.registered())
        return Verdict(responses, shutdown, message, stuck,
                       finish=shared_counts([gathered[r].lanes for r in shutdown]))

    def _check_stalls(self) -> None:
        """On each coordinator, between rounds. A stall that must become an error
        is held until the next full round, which the held message requests."""
        for state in self.registry.members():
            if state.coordinator is not None:
                message = self._inspectors[state.set_id].check(state.coordinator)
                if message:
                    self._stall_messages[state.set_id] = message

    def _dispatch(self, state: SetState, responses: Sequence[Response], cached: bool,
                  plan_key: Optional[tuple] = None) -> None:
        now = time.monotonic()
        self._deadlock.agreed += len(responses)
        data, control, agreed = [], [], {}
        for response in responses:
            request = state.pending.pop(response.name, None)
            if request is not None:
                agreed[response.name] = request
                request.agreed_at = now
                if (timeline := self.timeline) is not None:
                    timeline.agreed(request, now, runs=not response.error)
            if response.error:
                if request is not None:
                    self._fail(request, error_class(response.error_kind)(
                        f"rank {self.transport.rank}: {response.error}"))
                continue
            if not cached and response.desc.kind in CACHEABLE:
                state.cache.insert(response, request.desc if request else response.desc)
                self.executor.forget_plans()
            state.cache.touch(response.name)
            kind = response.desc.kind
            if kind is not Kind.ALLREDUCE and kind in _CONTROL:   # `in` hashes: Python code
                control.append((response, request))
            elif request is not None or kind is Kind.ALLREDUCE:
                data.append(response)   # an allreduce without a request: joined, sends zeros
        self._sentinel.inside = (now, state.ranks)   # a peer lost in there: sentinel.py
        self.executor.run(state.set_id, data, agreed, plan_key)
        self._sentinel.inside = None
        if not cached and any(r.desc.kind is Kind.JOIN for r in data):
            self.lanes.square_up(self.transport.allgather)    # every rank, at the join's end
        for response, request in control:
            self._control(state, response, request)

    def _control(self, state: SetState, response: Response, request: Optional[Request]) -> None:
        """Run an agreed add/remove/reconfigure (negotiated on the global set, so every
        rank runs it at the same point in the order of collectives)."""
        desc = response.desc
        result: Any = None
        if desc.kind is Kind.OPEN_LANE:
            result = self._open_lane(state, desc)
        elif desc.kind is Kind.ADD_PROCESS_SET:
            result = self.registry.add(tuple(desc.ranks or ()), state.comm)
        elif desc.kind is Kind.REMOVE_PROCESS_SET:
            removed = HvdliteError(
                f"process set {desc.set_id} was removed while collectives on it were pending")
            result = self.registry.remove(desc.set_id, lambda r: self._fail(r, removed))
            self._inspectors.pop(desc.set_id, None)
        else:
            self.executor.drain()
            self.config = self.config.replace(**dict(desc.settings))
            self._report_after = stall.report_after(self.config)
            self.executor.reconfigure(self.config)
            self._waiter.config = self._deadlock.config = self.config
            for inspector in self._inspectors.values():
                inspector.config = self.config
        if request is not None:
            self.complete(request, result)

    # -- completion (failing and stopping: stopping.py) -----------------------------------
    def complete(self, request: Request, result: Any) -> None:
        # set.discard is atomic under the GIL; the user side only adds under its lock.
        self._in_flight[request.process_set_id].discard(request.desc.name)
        if (timeline := self.timeline) is not None:
            timeline.done(request, time.monotonic())
        self.handles.complete(request.handle, result)
