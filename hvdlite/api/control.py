"""Lifecycle and control collectives: ``init`` with its process sets, adding and
removing process sets, and negotiated reconfiguration."""
from __future__ import annotations

from typing import Any, Optional, Sequence

from hvdlite.api import runtime
from hvdlite.api.process_set import ProcessSet
from hvdlite.api.submission import Call, synchronize
from hvdlite.core.requests import Kind
from hvdlite.errors import UsageError


def init(comm: Any = None, process_sets: Optional[Sequence[ProcessSet]] = None) -> None:
    """Start hvdlite on every rank of ``comm`` (default: COMM_WORLD).

    Args:
        comm: an mpi4py communicator, or a list of COMM_WORLD ranks to run on.
        process_sets: ProcessSets to register right away (same list on every rank).

    A second call while running is harmless. Settings come from HVDLITE_*
    variables (see hvdlite.config). Collective: every rank of ``comm`` calls it.
    """
    runtime.start(comm)
    for process_set in process_sets or ():
        add_process_set(process_set)


def add_process_set(process_set: Any) -> ProcessSet:
    """Register a process set; every rank calls this with the same ranks, in order."""
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    world = runtime.size()
    if ps.ranks[-1] >= world or ps.ranks[0] < 0:
        raise UsageError(f"{ps!r} names ranks outside 0..{world - 1}")
    if runtime.engine().registry.id_of(ps.ranks) is not None:
        raise UsageError(f"a process set with ranks {ps.ranks} is already registered")
    call = Call(Kind.ADD_PROCESS_SET, None, None)
    ps.process_set_id = synchronize(call.submit(None, ranks=tuple(ps.ranks)))
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a set on every rank; False if it was not registered."""
    set_id = process_set.process_set_id
    if set_id in (None, 0) or runtime.engine().registry.ranks_of(set_id) is None:
        return False
    removed = synchronize(Call(Kind.REMOVE_PROCESS_SET, None, None).submit(None, set_id=set_id))
    process_set.process_set_id = None
    return bool(removed)


def reconfigure(**settings: Any) -> None:
    """Change settings (e.g. ``allreduce="ring"``) on every rank at the same point in
    the order of collectives: a negotiated request, so the engine never sees a
    setting change under a collective in flight. Collective: every rank calls it
    with the same settings (a MismatchError otherwise)."""
    runtime.config().replace(**settings)      # validates the names before negotiating
    call = Call(Kind.RECONFIGURE, None, None)
    synchronize(call.submit(None, settings=tuple(sorted(settings.items()))))
