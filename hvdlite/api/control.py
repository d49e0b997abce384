"""Lifecycle and control collectives: ``init`` with its process sets, adding and
removing process sets, and negotiated reconfiguration."""
from __future__ import annotations

from typing import Any, Optional, Sequence, Union

from hvdlite.api import objects, runtime
from hvdlite.api.process_set import ProcessSet, global_process_set
from hvdlite.api.submission import Call, synchronize
from hvdlite.backends import registry
from hvdlite.errors import UsageError
from hvdlite.negotiation.requests import Kind
from hvdlite.negotiation.set_agreement import RequestedSets, agree_on_sets

ProcessSets = Union[Sequence[ProcessSet], str, None]


def init(comm: Any = None, process_sets: ProcessSets = None) -> None:
    """Start hvdlite on every rank of ``comm`` (default: COMM_WORLD).

    Args:
        comm: an mpi4py communicator, or a list of COMM_WORLD ranks to run on.
        process_sets: ProcessSets to register from the start (the same sets, in the
            same order, on every rank; each gets its ``process_set_id``), or
            ``"dynamic"`` (Horovod's spelling for "sets are added later", which
            hvdlite always allows).

    A refused list (a duplicate set, one naming ranks outside the job, lists that
    differ between ranks) raises UsageError, a ValueError, on every rank and changes
    nothing: a first call leaves hvdlite not started, a call while running registers
    none of the sets, so a corrected call works. A second call while running is
    otherwise harmless. Settings come from HVDLITE_* variables (see hvdlite.config);
    MPI is initialised here if the program left it to hvdlite
    (``mpi4py.rc.initialize = False``). Collective: every rank of ``comm`` calls it.
    """
    sets, requested = _requested(process_sets)
    if runtime.start(comm, requested):
        registry = runtime.engine("hvdlite.init()").registry
        for process_set in sets:
            process_set.process_set_id = registry.id_of(process_set.ranks)
    elif sets or isinstance(requested, str):
        _add_while_running(sets, requested)


def _requested(process_sets: ProcessSets) -> tuple[list[ProcessSet], RequestedSets]:
    """The ProcessSets asked for and what this rank tells the others: their ranks, or
    why its argument is unusable (then every rank raises, not only this one)."""
    if process_sets is None or (isinstance(process_sets, str)
                                and process_sets.lower() == "dynamic"):
        return [], ()
    if isinstance(process_sets, str) or not hasattr(process_sets, "__iter__"):
        return [], (f"process_sets={process_sets!r}: expected a list of ProcessSet "
                    "objects or 'dynamic'")
    sets = list(process_sets)
    for index, entry in enumerate(sets):
        if entry is global_process_set:
            return [], (f"entry {index} is hvd.global_process_set, which is always "
                        "registered; leave it out")
        if not isinstance(entry, ProcessSet):
            return [], (f"entry {index} is a {type(entry).__name__}, not a ProcessSet "
                        "(pass ProcessSet objects: they are what collectives take as "
                        "process_set=)")
    return sets, [tuple(process_set.ranks) for process_set in sets]


def _add_while_running(sets: list[ProcessSet], requested: RequestedSets) -> None:
    """init(process_sets=...) on a running hvdlite: register the sets once every rank
    agreed to the same list. An add fails after that only if the engine stops, and
    then no set is usable anyway."""
    engine = runtime.engine("hvdlite.init()")
    everyone = objects.allgather_object(requested, name="hvdlite.init.process_sets")
    agree_on_sets(everyone, runtime.size(), engine.registry.registered(), runtime.rank())
    for process_set in sets:
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


def reconfigure(*, name: Optional[str] = None, **settings: Any) -> None:
    """Change settings (e.g. ``allreduce="ring"``) on every rank at the same point in
    the order of collectives: a negotiated request, so the engine never sees a
    setting change under a collective in flight. Collective: every rank calls it
    with the same settings (a MismatchError otherwise). ``name`` names the request,
    as any collective's: unnamed ones are numbered per thread, so a caller on a thread
    named differently on each rank (TensorFlow runs a ``py_function`` on pool threads)
    must name it."""
    changed = runtime.config().replace(**settings)   # validates before negotiating
    registry.check(changed.backends)     # an unregistered backend fails here, on every rank
    call = Call(Kind.RECONFIGURE, name, None)
    synchronize(call.submit(None, settings=tuple(sorted(settings.items()))))
