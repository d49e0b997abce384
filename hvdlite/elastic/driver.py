"""``hvd.elastic.run``: run a training function, resume it, recover it.

An MPI world cannot shrink or grow in place, so hvdlite recovers by restarting:

- On entry, rank 0 loads the state committed in ``HVDLITE_ELASTIC_DIR`` (if a
  previous run of the job left one) and ``sync()`` gives it to every rank. A
  resume is a reset, as a restart after a failure replaces Horovod's in-place
  reset: ``State.reset()`` and the callbacks of ``register_reset_callbacks`` run
  (after the sync, on every rank, at the world size of this run) before the
  function is called, so a script rescales its learning rate to ``hvd.size()``
  (a committed optimizer carries the old world's rate). A first start, with
  nothing committed, runs no callbacks, as in Horovod.
- A collective failure (Horovod's ``HorovodInternalError``) while the world is
  still whole (the engine runs) restores the last commit in memory and calls
  the function again. When the world is broken (a lost peer, a stopped
  engine) the error ends the process, the job fails, and ``hvdliterun
  --elastic`` (or the scheduler) starts it again from the file.
- A ``HostsUpdatedInterrupt`` resets and calls the function again without
  restoring, as in Horovod.
- Preemption (SIGUSR1, agreed at a step boundary) writes the last commit, shuts
  hvdlite down and exits with ``PREEMPTED_EXIT_CODE`` on every rank.
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Callable, TypeVar

from hvdlite.api import runtime
from hvdlite.elastic import preemption
from hvdlite.elastic.state import State
from hvdlite.errors import CollectiveFailedError, HostsUpdatedError

_log = logging.getLogger("hvdlite")
F = TypeVar("F", bound=Callable[..., Any])


def world_is_whole() -> bool:
    """Whether collectives can still complete: hvdlite runs and its engine is alive."""
    from hvdlite.api import runtime
    engine = runtime.RUNTIME.engine
    return engine is not None and engine.dead is None


def run_fn(func: F, reset: Callable[[], None]) -> F:
    """Wrap ``func(state, *args, **kwargs)`` as described in the module doc;
    ``reset`` adapts the binding after a reset (hvdlite keeps its world: no-op)."""

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(state, State):
            raise TypeError(f"hvd.elastic.run: the first argument must be an elastic State "
                            f"(e.g. hvd.elastic.TorchState), not {type(state).__name__}")
        preemption.install()
        try:
            resumed = _load(state)
            skip_sync = False
            while True:
                try:
                    if not skip_sync:
                        state.sync()
                    if resumed:
                        # A restart is this job's reset event (Horovod's on_reset after a
                        # worker left or came), and the world may have another size now.
                        resumed = False
                        state.on_reset()
                    return func(state, *args, **kwargs)
                except CollectiveFailedError as exc:
                    if not world_is_whole():
                        raise       # the job ends; a restart resumes from the last file
                    _log.warning("collective failed (%s); restoring the last commit and "
                                 "retrying", exc)
                    state.restore()
                    skip_sync = False
                except HostsUpdatedError as exc:
                    skip_sync = exc.skip_sync
                reset()
                state.on_reset()
        except preemption.Preempted:
            _leave_preempted()
        finally:
            preemption.uninstall()

    return wrapper  # type: ignore[return-value]


def _load(state: State) -> bool:
    """Rank 0 loads the committed file, if any; every rank learns whether it did
    (collective: one small broadcast), so every rank runs the reset callbacks, and
    takes rank 0's commit count, so ``commit()`` numbers agree across ranks."""
    found = state.load_persisted()
    resumed, commits = state._bcast_object((found, state._commits))
    state._commits = state._persisted = commits
    if resumed and state._rank() == 0:
        _log.info("resumed from the committed state: running the reset callbacks")
    return resumed


def _leave_preempted() -> None:
    """Every rank gets here at the same step boundary: shut down together (a clean
    MPI end, so the launcher reports our code), then exit with the requeue code."""
    if runtime.is_initialized() and runtime.rank() == 0:
        print(f"[hvdlite] preempted: the last commit is saved; exiting with "
              f"{preemption.PREEMPTED_EXIT_CODE} so the job is requeued", flush=True)
    runtime.shutdown()
    raise SystemExit(preemption.PREEMPTED_EXIT_CODE)


def _no_reset() -> None:
    pass


def run(func: F) -> F:
    """Decorator: Horovod's ``hvd.elastic.run`` (see the module doc)."""
    return run_fn(func, _no_reset)
