"""Deadlock detection: every rank blocked in hvdlite on tensors another rank has not
submitted, with no rank free to submit them. Unlike a stall (some rank is slow, or
busy elsewhere), such a job can never move again, so it becomes an error on every
rank instead of a warning.

Each round, every rank says in its global-set flag word whether it is *blocked*: a
user thread is waiting in hvdlite (``synchronize``, a blocking collective, join())
and nothing has moved on this rank since its last round (no submission, no
agreement, no backend work in flight). The bitwise AND of the words tells every
rank whether all of them are. The global set's coordinator times how long that
lasts; after half of HVDLITE_STALL_CHECK_TIME it asks, by clearing
``NO_DEADLOCK_CHECK`` in its word, for a full round in which each blocked rank
lists its pending requests. If every rank is still blocked and nothing was agreed,
its verdict names each rank's pending tensors and the likely cause, and every rank
fails all its pending requests with ``DeadlockError`` (a ``MismatchError``). The
engine keeps running: the next collective works.

A rank that is merely slow (computing, evaluating, loading data) is not waiting in
hvdlite, so it is never blocked, and the others only get the stall warning.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Optional, Sequence

from hvdlite.negotiation.requests import Kind, Response

# Flag bits of a round vector's first word (after process_sets' NO_FULL_ROUND, RANK_IDLE).
BLOCKED = 4             # "a user thread of mine waits on tensors not agreed; nothing moved"
NO_DEADLOCK_CHECK = 8   # cleared by the global coordinator: "list your pending requests"

_LISTED = 3   # tensors named per rank; a bucket of 200 gradients is "and 197 more"

# (set id, name, collective, whether a user thread waits on it)
Pending = list[tuple[int, str, str, bool]]


class DeadlockWatch:
    """One per engine. Every rank computes its flag bits; the global set's
    coordinator (``coordinator=True``) also times the all-blocked streak."""

    def __init__(self, handles: Any, config: Any, coordinator: bool) -> None:
        self._handles = handles
        self.config = config      # replaced by a negotiated reconfiguration
        self._coordinator = coordinator
        self.agreed = 0           # responses dispatched: bumped by the engine
        self._seen = (-1, -1)     # (handles created, agreed) at the last flags()
        self.blocked = False      # this rank, in the current iteration
        self.checking = False     # the current round asks for pending lists
        self.due = False          # coordinator: the next global round must check
        self._since: Optional[float] = None   # coordinator: all blocked since

    def flags(self, busy: bool) -> int:
        """This rank's bits for the global set's next round. ``busy``: backend work
        is in flight (a collective is running, so a waiting thread will wake)."""
        seen = (self._handles.created, self.agreed)
        moved, self._seen = seen != self._seen, seen
        self.blocked = bool(self._handles.waiting) and not busy and not moved
        word = BLOCKED if self.blocked else 0
        return word if self.due else word | NO_DEADLOCK_CHECK

    def observe(self, word: int) -> None:
        """After the global round: ``word`` is the AND of every rank's flags."""
        self.checking = not word & NO_DEADLOCK_CHECK
        if not self._coordinator or self.checking:    # judge() ends a checking round
            return
        if not word & BLOCKED:
            self._since = None
            return
        window = self.config.stall_check_time / 2
        now = time.monotonic()
        if self._since is None:
            self._since = now
        elif window > 0 and now - self._since >= window:
            self.due = True

    def pending(self, members: Sequence[Any], lanes: Any = None) -> Optional[Pending]:
        """This rank's pending requests on every set and its buckets on lanes
        (hvdlite/engine/lane.py), if the round asks and this rank is blocked (None
        otherwise: the coordinator then sees it is not)."""
        if not (self.checking and self.blocked):
            return None
        waited = self._handles.parked()
        return [(state.set_id, name, request.desc.kind.value, request.handle in waited)
                for state in members for name, request in state.pending.items()
                ] + ([] if lanes is None else lanes.pending(waited))

    def judge(self, reports: Sequence[Any], responses: Sequence[Response],
              sets: dict[int, tuple[int, ...]]) -> str:
        """The coordinator's verdict in a checking round: a message if every rank
        is still blocked and this round agreed nothing, else ""."""
        if not self.checking:
            return ""
        since, self._since, self.due = self._since, None, False
        if responses or any(r.pending is None for r in reports):
            return ""
        waited = time.monotonic() - since if since is not None else 0.0
        return describe([r.pending for r in reports], sets, waited)


def fail_all(members: Sequence[Any], fail_set: Callable[[Any, BaseException], None],
             error: BaseException) -> None:
    """The verdict, on every rank: fail each set's pending requests and forget the
    reports this rank coordinates, so that the next collective works."""
    for state in members:
        fail_set(state, error)
        if state.coordinator is not None:
            state.coordinator.clear()


def describe(pending: Sequence[Pending], sets: dict[int, tuple[int, ...]],
             waited: float) -> str:
    """The deadlock message: what each rank (global rank = index) waits on, which
    ranks have not submitted it, and the likely cause."""
    have = [{(s, n) for s, n, _, _ in mine} for mine in pending]
    in_join = [r for r, mine in enumerate(pending)
               if any(k == Kind.JOIN.value and w for _, _, k, w in mine)]
    parts = []
    for rank, mine in enumerate(pending):
        if rank in in_join:
            parts.append(f"rank {rank} is in join()")
            continue
        waits = [(s, n, k) for s, n, k, w in mine if w] or [(s, n, k) for s, n, k, _ in mine]
        if not waits:       # not while blocked; said rather than left out, should it happen
            parts.append(f"rank {rank} has nothing pending")
            continue
        named = [_tensor(s, n, k, sets, have, in_join) for s, n, k in waits[:_LISTED]]
        more = f" and {len(waits) - _LISTED} more" if len(waits) > _LISTED else ""
        parts.append(f"rank {rank} waits on {', '.join(named)}{more}")
    return (f"Deadlock: for {waited:.1f} s every rank has been waiting in hvdlite for a "
            "collective that another rank has not submitted, and no rank is free to "
            f"submit it, so the job can never continue: {'; '.join(parts)}. "
            "Likely cause: the ranks ran different numbers of batches (uneven data per "
            "rank), so one rank reached a collective (the epoch's metric average, the "
            "next step's gradients) that the others never call. Give every rank the "
            "same number of batches: steps_per_epoch computed from the smallest shard "
            "(Keras fit), hvdlite.torch.elastic.ElasticSampler, or hvd.join() on a rank "
            "whose data has run out (the others' allreduces then complete without it). "
            "Otherwise a collective is called on some ranks only: under a condition that "
            "holds on some ranks and not others (a step skipped where the rank's own "
            "gradients are not finite, checked before they are averaged, leaves its "
            "allreduce to the others), or under names that differ between ranks.")


def _tensor(set_id: int, name: str, kind: str, sets: dict[int, tuple[int, ...]],
            have: Sequence[set], in_join: Sequence[int]) -> str:
    """"allreduce 'x' (not submitted by ranks [1])", with the set when not global."""
    members = sets.get(set_id, ())
    # A rank in join() stands in for allreduces: it is not missing from them.
    missing = [m for m in members if (set_id, name) not in have[m]
               and not (kind == Kind.ALLREDUCE.value and m in in_join)]
    where = f" on process set {set_id} (ranks {list(members)})" if set_id else ""
    absent = f" (not submitted by ranks {missing})" if missing else ""
    return f"{kind} '{name}'{where}{absent}"
