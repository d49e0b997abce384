"""The coordinator's side of negotiation, free of MPI so it can be unit-tested.

In a full round every member rank sends the descriptors of its pending
requests; the coordinator (rank 0 of the process set) keeps them in a table
until every non-joined rank has reported a name, then validates the reports
against each other and emits a Response (or an error Response naming what
differed). Responses go back to every rank in one broadcast, so all ranks run
the same collectives in the same order.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Optional, Sequence

from hvdlite.errors import ErrorKind
from hvdlite.negotiation.requests import Descriptor, Kind, ReduceOp, Response

# Fields compared between ranks, per kind, after the collective itself and the
# submitting thread of unnamed ops. Allgather and alltoall compare the shape
# without its first dimension, which may differ per rank.
_COMPARED: dict[Kind, tuple[str, ...]] = {
    Kind.ALLREDUCE: ("device", "dtype", "parts", "shape", "op", "prescale", "postscale"),
    Kind.REDUCESCATTER: ("device", "dtype", "shape", "op", "prescale", "postscale", "splits"),
    Kind.BROADCAST: ("device", "dtype", "shape", "root"),
    Kind.ALLGATHER: ("device", "dtype", "trailing_shape"),
    Kind.ALLTOALL: ("device", "dtype", "trailing_shape"),
    Kind.BARRIER: (),
    Kind.JOIN: (),
    Kind.ADD_PROCESS_SET: ("ranks",),
    Kind.REMOVE_PROCESS_SET: ("set_id",),
    Kind.RECONFIGURE: ("settings",),
    Kind.OPEN_LANE: ("dtype", "shape", "settings", "splits"),
}

_FIX_HINT = ("Every rank must submit a tensor name with the same collective, dtype, "
             "shape (allgather/alltoall: all but the first dimension), op, root rank "
             "and scale factors; check the code paths that differ between ranks.")


def _field(desc: Descriptor, field: str) -> object:
    if field == "trailing_shape":
        return desc.shape[1:]
    value = getattr(desc, field)
    if field == "op":
        return ReduceOp(value).name
    if field == "kind":
        return value.value
    if field == "device":      # "cuda:0" on one rank and "cuda:1" on another is one GPU each
        return value.split(":", 1)[0]
    return value


_LABELS = {"kind": "collective", "thread": "submitting thread",
           "parts": "shapes of the grouped tensors bundled"}   # () where not bundled
_THREAD_HINT = ("Unnamed collectives submitted from several threads pair up in a "
                "different order on each rank; give each collective a name (name=...) "
                "that is the same on every rank.")


def find_marker(reports: dict[int, Descriptor]) -> Optional[str]:
    """A message for ranks whose own arguments were invalid (error markers), or None."""
    bad = [(rank, desc) for rank, desc in sorted(reports.items()) if desc.error]
    if not bad:
        return None
    reasons = "; ".join(f"rank {rank}: {desc.error}" for rank, desc in bad)
    name = bad[0][1].name
    return (f"{bad[0][1].kind.value} '{name}' was called with invalid arguments on ranks "
            f"{[rank for rank, _ in bad]} ({reasons}), so it cannot run on any rank. "
            "Fix the arguments on those ranks; the next collective is unaffected.")


def find_mismatch(reports: dict[int, Descriptor]) -> Optional[str]:
    """Return a message naming the tensor, the ranks and what differed, or None."""
    ranks = sorted(reports)
    reference = reports[ranks[0]]
    for field in ("kind", "thread") + _COMPARED[reference.kind]:
        values: dict[object, list[int]] = {}
        for rank in ranks:
            values.setdefault(_field(reports[rank], field), []).append(rank)
        if len(values) > 1:
            label = _LABELS.get(field, field)
            listing = "; ".join(f"ranks {group} have {label}={value!r}"
                                for value, group in values.items())
            hint = _THREAD_HINT if field == "thread" else _FIX_HINT
            return f"Mismatched {label} for tensor '{reference.name}': {listing}. {hint}"
    if reference.kind is Kind.ALLTOALL:
        return _check_alltoall_splits(reports, len(ranks))
    return None


def _check_alltoall_splits(reports: dict[int, Descriptor], size: int) -> Optional[str]:
    for rank, desc in sorted(reports.items()):
        if desc.splits is not None and len(desc.splits) != size:
            return (f"alltoall '{desc.name}': rank {rank} gave {len(desc.splits)} splits "
                    f"for a process set of {size} ranks; pass one split per rank.")
    return None


def build_response(reports: dict[int, Descriptor], joined: Sequence[int],
                   members: Optional[Sequence[int]] = None) -> Response:
    """A validated Response for a name every non-joined member has reported (or, while
    a rank is joined, for anything but an allreduce: an error). ``members`` maps the
    set's ranks to global ranks, for messages (default: the global set)."""
    ranks = sorted(reports)
    desc = reports[ranks[0]]
    marker = find_marker(reports)
    if marker:
        return Response(desc=desc, error=marker, error_kind=ErrorKind.MISMATCH)
    if joined and desc.kind is not Kind.ALLREDUCE:
        # Before comparing: the reports may be some of the ranks' only.
        named = sorted(joined) if members is None else [members[r] for r in sorted(joined)]
        return Response(desc=desc, error_kind=ErrorKind.JOIN, error=(
            f"{desc.kind.value} '{desc.name}' cannot run while ranks {named} are in "
            "join(): a joined rank takes part only in allreduce until every rank has "
            f"joined. Call {desc.kind.value} on every rank before any of them calls "
            "join(), or after join() has returned."))
    mismatch = find_mismatch(reports)
    if mismatch:
        return Response(desc=desc, error=mismatch, error_kind=ErrorKind.MISMATCH)
    response = Response(desc=desc, joined=tuple(sorted(joined)))
    if desc.kind is Kind.ALLGATHER:
        response.first_dims = tuple(reports[r].shape[0] if reports[r].shape else 1 for r in ranks)
    elif desc.kind is Kind.ALLTOALL:
        response.split_matrix = tuple(_splits_of(reports[r], len(ranks)) for r in ranks)
    return response


def _splits_of(desc: Descriptor, size: int) -> tuple[int, ...]:
    if desc.splits is not None:
        return desc.splits
    rows = desc.shape[0] if desc.shape else 0
    return tuple(rows // size + (1 if r < rows % size else 0) for r in range(size))


@dataclasses.dataclass
class _Entry:
    reports: dict[int, Descriptor]
    first_seen: float
    warned: bool = False


def _joins(entry: _Entry) -> bool:
    return any(d.kind is Kind.JOIN for d in entry.reports.values())


def _only_allreduce(entry: _Entry) -> bool:
    return all(d.kind is Kind.ALLREDUCE for d in entry.reports.values())


class Coordinator:
    """The message table of one process set, held by its rank 0.

    A rank in join() is joined on every set it belongs to: on the global set its
    JOIN request says so; on another set its report says so each full round
    (``ingest(..., joined=True)``), since join() is submitted to the global set only."""

    def __init__(self, size: int, members: Optional[Sequence[int]] = None) -> None:
        self.size = size
        self.members = members      # the set's global ranks, for messages
        self._table: dict[str, _Entry] = {}
        self._join_order: dict[int, int] = {}
        self._flagged: set[int] = set()     # ranks whose report this round says "in join()"
        self._joined_now: frozenset[int] = frozenset()   # as of the last responses()
        self._round = 0

    def ingest(self, rank: int, descs: Sequence[tuple[Descriptor, float]],
               now: Optional[float] = None, joined: bool = False) -> None:
        """Record a rank's pending descriptors; ``age`` is how long it has waited.
        ``joined``: the rank is in join() (reported on sets other than the global one)."""
        now = time.monotonic() if now is None else now
        if joined:
            self._flagged.add(rank)
        for desc, age in descs:
            entry = self._table.get(desc.name)
            if entry is None:
                entry = self._table[desc.name] = _Entry({}, now - age)
            entry.first_seen = min(entry.first_seen, now - age)
            entry.reports[rank] = desc
            if desc.kind is Kind.JOIN and rank not in self._join_order:
                self._join_order[rank] = self._round

    def joined(self) -> list[int]:
        """Ranks that have called join() and not yet been released."""
        return sorted(self._join_order)

    def responses(self) -> list[Response]:
        """Responses for every name now complete, in first-seen order. While a rank is
        joined, anything but an allreduce fails at once for the ranks that reported it:
        the joined rank leaves join() only once every rank has joined, so it cannot
        run, and waiting for the other ranks' reports would hang wherever they submit
        it under another name (unnamed ops counted differently on each rank)."""
        self._round += 1
        joined_set = set(self._join_order) | self._flagged
        self._flagged = set()
        self._joined_now = frozenset(joined_set)
        joined = sorted(joined_set)
        ready = []
        for name, entry in sorted(self._table.items(), key=lambda kv: kv[1].first_seen):
            if _joins(entry):
                continue
            if ((joined and not _only_allreduce(entry))
                    or all(r in entry.reports or r in joined_set for r in range(self.size))):
                ready.append(build_response(entry.reports, joined, self.members))
        for response in ready:
            del self._table[response.name]
        join = self._join_response(set(self._join_order))
        return ready + ([join] if join else [])

    def clear(self) -> None:
        """Forget every report and join (the ranks failed all their pending requests)."""
        self._table.clear()
        self._join_order.clear()
        self._flagged = set()
        self._joined_now = frozenset()

    def _join_response(self, joined: set[int]) -> Optional[Response]:
        join_names = [n for n, e in self._table.items()
                      if any(d.kind is Kind.JOIN for d in e.reports.values())]
        if len(joined) < self.size or not join_names:
            return None
        # The last rank to join: latest round first seen, highest rank on ties.
        last = max(self._join_order, key=lambda r: (self._join_order[r], r))
        desc = self._table.pop(join_names[0]).reports[last]
        self._join_order.clear()
        return Response(desc=desc, joined=tuple(sorted(joined)), result=last)

    def forget(self, names: Sequence[str]) -> None:
        """Drop names that were agreed through the cached fast path."""
        for name in names:
            self._table.pop(name, None)

    def stalled(self, now: float, after: float) -> list[tuple[str, list[int], list[int], float]]:
        """(name, ranks waiting, ranks missing, seconds) for tensors waiting >= after."""
        found = []
        for name, entry in self._table.items():
            if _joins(entry):
                continue  # waiting in join() for slower ranks is expected, not a stall
            waited = now - entry.first_seen
            if waited >= after:
                have = sorted(entry.reports)
                missing = [r for r in range(self.size)
                           if r not in entry.reports and r not in self._joined_now]
                if missing:
                    found.append((name, have, missing, waited))
        return found

    def mark_warned(self, name: str) -> bool:
        """True the first time a stalled name is warned about."""
        entry = self._table.get(name)
        if entry is None or entry.warned:
            return False
        entry.warned = True
        return True


@dataclasses.dataclass
class Report:
    """What one rank sends in a full round."""
    descs: list
    shutdown: bool
    joined: bool = False        # in join(): said on sets other than the global one
    pending: Optional[list] = None   # asked for by a deadlock check (failure/deadlock.py)
    lanes: Optional[dict] = None     # shutting down: each lane's collectives finished, by key


@dataclasses.dataclass
class Verdict:
    """What the coordinator broadcasts after a full round."""
    responses: list[Response]
    shutdown_ranks: list[int]
    stall: str = ""
    deadlock: str = ""          # every rank is blocked for good: fail their pending requests
    # A shutdown: by lane key, the collectives every rank that shut down finished: the
    # others finish theirs too before they stop.
    finish: dict = dataclasses.field(default_factory=dict)
