"""``ProcessSet``: a value holding global ranks and, once registered, an id.

The engine's registry owns everything else (communicators, caches, pending
requests). The hash depends on the ranks only, so it never changes when a
set is registered, removed or re-added.
"""
from __future__ import annotations

import sys
from typing import Any, Iterable, Optional, Union

from hvdlite.errors import UsageError
from hvdlite.transport import choice


class ProcessSet:
    """A set of global ranks. Register it with ``add_process_set`` (on every rank,
    in the same order) before passing it as ``process_set=``.

    As Horovod's, it takes either the ranks or an mpi4py communicator (``mpi_comm``),
    whose members are the set: their ranks in the world hvdlite runs on (MPI's
    ``COMM_WORLD`` before ``init()``). Under torchrun, whose ranks are no MPI
    processes, a communicator is a UsageError."""

    def __init__(self, ranks_or_comm: Union[Iterable[int], Any]) -> None:
        self.mpi_comm = _communicator(ranks_or_comm)
        ranks = ranks_or_comm if self.mpi_comm is None else _world_ranks(self.mpi_comm)
        try:
            unique = tuple(sorted({int(r) for r in ranks}))
        except TypeError:
            raise UsageError(f"a ProcessSet takes a list of ranks or an mpi4py communicator, "
                             f"not {ranks_or_comm!r}") from None
        if not unique:
            raise UsageError("a ProcessSet needs at least one rank")
        self._ranks: Optional[tuple[int, ...]] = unique
        self.process_set_id: Optional[int] = None

    @property
    def ranks(self) -> list[int]:
        return list(self._ranks or ())

    def size(self) -> int:
        return len(self.ranks)

    def included(self) -> bool:
        from hvdlite.api import runtime
        return runtime.rank() in self.ranks

    def rank(self) -> int:
        """This process's rank within the set (-1 if not included)."""
        from hvdlite.api import runtime
        me = runtime.rank()
        ranks = self.ranks
        return ranks.index(me) if me in ranks else -1

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ProcessSet) and (self.ranks, self.process_set_id) == (
            other.ranks, other.process_set_id)

    def __hash__(self) -> int:
        return hash(("ProcessSet", self._ranks))


def _communicator(candidate: Any) -> Any:
    """``candidate`` if it is an mpi4py communicator (only looked for where mpi4py is
    imported already: importing it here would start MPI), else None."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not isinstance(candidate, mpi.Comm):
        return None
    world = choice.chosen()
    if world.name != "mpi":
        raise UsageError(f"ProcessSet(communicator): this job was started by {world.started_by} "
                         f"and runs on the {world.name} transport, whose ranks are not MPI "
                         "processes; pass the list of ranks")
    if candidate == mpi.COMM_NULL:
        raise UsageError("ProcessSet(MPI.COMM_NULL): this rank is not in the communicator; "
                         "pass a communicator this rank belongs to, or the list of ranks")
    return candidate


def _world_ranks(comm: Any) -> list[int]:
    """The ranks of ``comm``'s members in the world hvdlite runs on (MPI's COMM_WORLD
    before init())."""
    from hvdlite.api import runtime
    from hvdlite.transport import mpi_transport     # MPI runs: the program made ``comm``
    engine = runtime.RUNTIME.engine
    return mpi_transport.world_ranks(comm, None if engine is None else engine.transport)


class _GlobalProcessSet(ProcessSet):
    """Every rank of the job: id 0 from the start, ranks known once init() ran."""

    def __init__(self) -> None:
        self._ranks = None
        self.process_set_id = 0
        self.mpi_comm = None

    @property
    def ranks(self) -> list[int]:
        from hvdlite.api import runtime
        return list(range(runtime.size()))

    def __repr__(self) -> str:
        # Shown before init() too: it is the default of process_set= arguments, which
        # help() and inspect.signature() print.
        from hvdlite.api import runtime
        if not runtime.is_initialized():
            return "ProcessSet(process_set_id=0, ranks=every rank, once hvdlite.init() ran)"
        return super().__repr__()


global_process_set: ProcessSet = _GlobalProcessSet()
