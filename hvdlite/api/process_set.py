"""``ProcessSet``: a value holding global ranks and, once registered, an id.

The engine's registry owns everything else (communicators, caches, pending
requests). The hash depends on the ranks only, so it never changes when a
set is registered, removed or re-added.
"""
from __future__ import annotations

from typing import Iterable, Optional

from hvdlite.errors import UsageError


class ProcessSet:
    """A set of global ranks. Register it with ``add_process_set`` (on every rank,
    in the same order) before passing it as ``process_set=``."""

    def __init__(self, ranks: Iterable[int]) -> None:
        unique = tuple(sorted({int(r) for r in ranks}))
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


class _GlobalProcessSet(ProcessSet):
    """Every rank of the job: id 0 from the start, ranks known once init() ran."""

    def __init__(self) -> None:
        self._ranks = None
        self.process_set_id = 0

    @property
    def ranks(self) -> list[int]:
        from hvdlite.api import runtime
        return list(range(runtime.size()))


global_process_set: ProcessSet = _GlobalProcessSet()
