"""How the engine stops: a shutdown asked for, a verdict that ends it (a peer shut
down, a stall, a lost peer), and a crash of the engine thread itself.

``Engine`` (engine.py) inherits these methods from ``Stoppable``. They live apart so
that engine.py reads as the round loop. They are inherited, not delegated to an object
of their own, because they share the engine's state (``dead``, the submission lock and
queue, the names in flight) with its hot path, which reads that state as the engine's
own attributes: a separate object would put a layer of lookups in between, and a
method found on a base class costs no more per call than one on the class itself.

Whatever stops the engine fails every request still queued or pending with the same
error, and later submissions raise a fresh copy of it (``raise_if_dead``).
"""
from __future__ import annotations

import logging
import os
import threading
import time
import traceback
from typing import TYPE_CHECKING, Any, Optional

from hvdlite.errors import HvdliteError, PeerLostError
from hvdlite.failure import abort_on_error, liveness

if TYPE_CHECKING:    # annotations only: the engine builds these objects
    import collections

    from hvdlite.engine.handles import HandleTable
    from hvdlite.failure.sentinel import Sentinel
    from hvdlite.failure.waiting import Doorbell
    from hvdlite.negotiation.process_sets import ProcessSetRegistry, SetState
    from hvdlite.negotiation.requests import Request
    from hvdlite.recording.timeline import Timeline
    from hvdlite.transport.base import Transport
    from hvdlite.transport.topology import Topology

_log = logging.getLogger("hvdlite")


class Stoppable:
    """The engine's ways of stopping. The attributes below are the engine's own, set
    by ``Engine.__init__`` (and ``_setup``: topology, sentinel); they are declared here
    so that these methods are type-checked against them."""

    config: Any
    transport: Transport
    topology: Optional[Topology]
    timeline: Optional[Timeline]
    handles: HandleTable
    registry: ProcessSetRegistry
    dead: Optional[HvdliteError]
    _shutdown_requested: bool
    _submit_lock: threading.Lock
    _queue: collections.deque[Request]
    _in_flight: dict[int, set[str]]
    _doorbell: Doorbell
    _thread: threading.Thread
    _sentinel: Sentinel

    # -- user-thread side -----------------------------------------------------------
    def raise_if_dead(self) -> None:
        """Raise a fresh error of the engine's cause of death, chained to it."""
        dead = self.dead
        if dead is not None:
            raise type(dead)(str(dead)) from dead

    def shutdown(self, timeout: float = 30.0) -> None:
        # From atexit the main thread is already marked stopped: the interpreter ends.
        exiting = not threading.main_thread().is_alive()
        if exiting and self.dead is None:
            abort_on_error.abort_if_exiting_with_error()   # before the peers hear "shutdown"
        self._shutdown_requested = True
        self._doorbell.ring_always()
        if (self._thread.is_alive() and threading.current_thread() is not self._thread
                and not isinstance(self.dead, PeerLostError)):   # maybe stuck in MPI for good
            self._thread.join(timeout)
            if self._thread.is_alive():
                _log.warning("hvdlite engine did not stop within %.0f s: another rank is "
                             "not taking part in negotiation", timeout)
                # Stuck inside MPI: MPI_Finalize at exit would be stuck the same way.
                abort_on_error.mark_broken(self.topology.rank, self.topology.size,
                                           f"the hvdlite engine is stuck inside {self.transport.label}")
        if self.timeline is not None:
            self.timeline.close()
            self.timeline = None
        if exiting:
            abort_on_error.abort_if_broken()   # an atexit hook registered during exit would not run

    # -- engine thread (and the sentinel's) -----------------------------------------
    def _lost(self, message: str) -> None:
        """Also the sentinel's verdict, on its thread, while this one is stuck in MPI.
        Reported before the user threads wake: under hydra, the first output after a
        rank was killed ends the job (exit_guard.py)."""
        if self.dead is None:
            abort_on_error.report_loss(self.topology.rank, self.topology.size, message)
            self._stop(PeerLostError(message))

    def _fail(self, request: Request, error: BaseException) -> None:
        self._in_flight.get(request.process_set_id, set()).discard(request.desc.name)
        self.handles.fail(request.handle, error)

    def fail_set(self, state: SetState, error: BaseException) -> None:
        for request in list(state.pending.values()):
            self._fail(request, error)
        state.pending.clear()

    def _stop(self, error: HvdliteError) -> None:
        with self._submit_lock:
            self.dead = error
        while self._queue:
            self._fail(self._queue.popleft(), error)
        for state in self.registry.members():
            self.fail_set(state, error)
        self.handles.fail_all(error)

    def _crash(self, exc: BaseException) -> None:
        if isinstance(exc, liveness.RoundAbandoned) or isinstance(self.dead, PeerLostError):
            return   # already stopped with PeerLostError; the user threads report it
        if isinstance(exc, self.transport.failures) and (lost := self._sentinel.explain()):
            self._lost(lost)   # it failed because a peer died (MPI: a copy from its memory)
            return
        rank = self.transport.rank
        text = "".join(traceback.format_exception(exc))
        self._stop(HvdliteError(f"hvdlite engine failed on rank {rank}: {exc!r}"))
        _log.error("hvdlite engine failed on rank %d; this is a bug, please report it:\n%s",
                   rank, text)
        if self.config.abort_on_error:
            time.sleep(abort_on_error.ABORT_GRACE_S)   # let the launcher forward the log first
            try:
                self.transport.abort(1)
            finally:
                os._exit(1)   # MPI_Abort may return once the launcher has the request
