"""Process sets: collectives over a subset of ranks, each negotiating on its own.

Adding or removing a set is itself negotiated on the global set, so every rank
creates (``MPI_Comm_split``) or frees the set's communicator at the same point
in the order of collectives.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Optional

from mpi4py import MPI

from hvdlite.core.requests import Kind, Request, Response
from hvdlite.errors import HvdliteError

if TYPE_CHECKING:
    from hvdlite.core.engine import Engine

CONTROL = frozenset({Kind.ADD_PROCESS_SET, Kind.REMOVE_PROCESS_SET})


class ProcessSet:
    """A set of global ranks. Register it with ``add_process_set`` (on every rank,
    in the same order) before passing it as ``process_set=``."""

    def __init__(self, ranks: Iterable[int]) -> None:
        ranks = sorted({int(r) for r in ranks})
        if not ranks:
            raise ValueError("a ProcessSet needs at least one rank")
        self.ranks: list[int] = ranks
        self.process_set_id: Optional[int] = None

    def _require_registered(self) -> int:
        if self.process_set_id is None:
            raise ValueError(f"{self!r} is not registered; call hvdlite.add_process_set() "
                             "on every rank first")
        return self.process_set_id

    def size(self) -> int:
        return len(self.ranks)

    def included(self) -> bool:
        from hvdlite.core import state
        return state.rank() in self.ranks

    def rank(self) -> int:
        """This process's rank within the set (-1 if not included)."""
        from hvdlite.core import state
        me = state.rank()
        return self.ranks.index(me) if me in self.ranks else -1

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ProcessSet) and (self.ranks, self.process_set_id) == (
            other.ranks, other.process_set_id)

    def __hash__(self) -> int:
        return hash(tuple(self.ranks))


def execute(engine: "Engine", response: Response, request: Optional[Request]) -> None:
    """Run an agreed add/remove on the engine thread."""
    if response.desc.kind is Kind.ADD_PROCESS_SET:
        result: Any = _add(engine, tuple(response.desc.ranks or ()))
    else:
        result = _remove(engine, response.desc.root)
    if request is not None:
        engine.complete(request, result)


def _add(engine: "Engine", ranks: tuple[int, ...]) -> int:
    world = engine.sets[0].comm
    member = world.Get_rank() in ranks
    comm = world.Split(0 if member else MPI.UNDEFINED, key=world.Get_rank())
    set_id = max(engine.set_ranks) + 1
    engine.add_set(set_id, ranks, comm if member else None)
    return set_id


def _remove(engine: "Engine", set_id: int) -> None:
    engine.set_ranks.pop(set_id, None)
    state = engine.sets.pop(set_id, None)
    if state is not None:
        engine.fail_set(state, HvdliteError(
            f"process set {set_id} was removed while collectives on it were pending"))
        state.comm.Free()
