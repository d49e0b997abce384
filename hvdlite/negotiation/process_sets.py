"""The engine's one registry of process sets, and each set's word in a round.

It allocates set ids, splits and frees each set's communicator, opens and
closes the set on every backend, and fails the set's pending requests when
the set goes away. Only the engine thread changes it; adds and removes are
themselves negotiated on the global set, so every rank changes its registry
at the same point in the order of collectives and ids agree everywhere. Ids
are never reused: a removed set's id stays retired, so a stale
``ProcessSet`` value can never address a newer set by accident.
"""
from __future__ import annotations

import array
import dataclasses
import time
from typing import Callable, Iterable, Optional

from hvdlite.negotiation.cache import ResponseCache
from hvdlite.negotiation.coordinator import Coordinator
from hvdlite.negotiation.requests import Kind, Request
from hvdlite.transport.base import Pending, Transport

GLOBAL_SET_ID = 0


class Round:
    """One set's negotiation round: its vector of 64-bit words and the transport's
    bitwise-AND allreduce over it (``Transport.band_round``), made once where the set is
    registered, a collective point on every member. ``start`` is the transport round's
    own bound method: the engine starts every set's round each cycle, and a forwarding
    call would be paid there."""

    def __init__(self, comm: Transport, words: int) -> None:
        self.vector = array.array("Q", bytes(8 * words))
        self._zeros = array.array("Q", bytes(8 * words))
        self._band = comm.band_round(self.vector)
        self.start: Callable[[], Pending] = self._band.start

    def cleared(self) -> array.array:
        """The vector, zeroed for the next round (written only between rounds)."""
        self.vector[:] = self._zeros
        return self.vector

    def free(self) -> None:
        """Before the transport is freed (an MPI round's request refers to it)."""
        self._band.free()


@dataclasses.dataclass
class SetState:
    """The engine's view of one process set this rank is a member of."""
    set_id: int
    ranks: tuple[int, ...]          # global ranks, ascending
    comm: Transport                 # private to the set: negotiation and data
    cache: ResponseCache
    coordinator: Optional[Coordinator]
    pending: dict[str, Request] = dataclasses.field(default_factory=dict)
    round: Round = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.round = Round(self.comm, 1 + self.cache.words)


class ProcessSetRegistry:
    def __init__(self, cache_capacity: int, on_open: Callable[[int, Transport], None],
                 on_close: Callable[[int], None]) -> None:
        self._cache_capacity = cache_capacity
        self._on_open, self._on_close = on_open, on_close
        self._members: dict[int, SetState] = {}      # sets this rank belongs to
        self._ranks: dict[int, tuple[int, ...]] = {}  # every registered set
        self._next_id = GLOBAL_SET_ID
        self._ordered: list[SetState] = []

    def _reorder(self) -> None:
        self._ordered = [self._members[i] for i in sorted(self._members)]

    # -- reads (any thread: plain dict lookups are atomic under the GIL) --------------------
    def ranks_of(self, set_id: int) -> Optional[tuple[int, ...]]:
        return self._ranks.get(set_id)

    def id_of(self, ranks: Iterable[int]) -> Optional[int]:
        wanted = tuple(ranks)
        return next((i for i, r in self._ranks.items() if r == wanted), None)

    def registered(self) -> dict[int, tuple[int, ...]]:
        """Every registered set's ranks, by id."""
        return dict(self._ranks)

    def only_world(self) -> bool:
        """Whether the global set is the only one registered (read every engine round)."""
        return len(self._ranks) == 1

    def member(self, set_id: int) -> Optional[SetState]:
        return self._members.get(set_id)

    def in_join(self) -> bool:
        """Whether this rank's join() is pending (join is submitted to the global set)."""
        request = self._members[GLOBAL_SET_ID].pending.get("join")
        return request is not None and request.desc.kind is Kind.JOIN

    def members(self) -> list[SetState]:
        """The sets this rank negotiates on, in id order (the same order everywhere).
        Read several times per engine iteration, so kept sorted, not sorted per call."""
        return self._ordered

    # -- changes (engine thread) --------------------------------------------------------------
    def add(self, ranks: tuple[int, ...], world: Transport) -> int:
        """Register a set on every rank of ``world`` (collective over ``world``)."""
        set_id = self._next_id
        self._next_id += 1
        comm: Optional[Transport]
        if set_id == GLOBAL_SET_ID:
            comm = world.dup()
        else:
            comm = world.split(0 if world.rank in ranks else None, key=world.rank)
        self._ranks[set_id] = ranks
        if comm is not None:
            coordinator = Coordinator(comm.size, ranks) if comm.rank == 0 else None
            self._members[set_id] = SetState(set_id, ranks, comm,
                                             ResponseCache(self._cache_capacity), coordinator)
            self._reorder()
            self._on_open(set_id, comm)
        return set_id

    def remove(self, set_id: int, fail: Callable[[Request], None]) -> bool:
        """Unregister a set; its pending requests go to ``fail``. False if unknown."""
        if set_id == GLOBAL_SET_ID or self._ranks.pop(set_id, None) is None:
            return False
        state = self._members.pop(set_id, None)
        if state is not None:
            self._reorder()
            for request in list(state.pending.values()):
                fail(request)
            state.pending.clear()
            self._on_close(set_id)
            state.round.free()
            state.comm.free()
        return True

    def close_all(self) -> None:
        for set_id in sorted(self._members):
            self._on_close(set_id)


# Flag bits of a round vector's first word; the bitwise AND tells each whether it
# holds on every member rank.
NO_FULL_ROUND = 1   # "this rank needs no full round"
RANK_IDLE = 2       # "this rank has nothing to do": pending nothing, in any set
# (4 and 8: deadlock.py's)


def round_vector(state: SetState, need_full: bool,
                 report_after: Optional[float], idle: bool = False) -> array.array:
    """This rank's word for the set's next negotiation round: the cache bits of its
    pending requests, the flag saying whether a full round can be skipped, and
    whether this rank is idle (``idle``). A request the cache does not know, or one
    pending longer than ``report_after`` seconds (it must be reported as a stall once),
    needs a full round.
    64-bit words in an ``array.array``, not NumPy: built once per round, and after an
    idle spell a NumPy allocation alone cost ~14 us of cold code here. It is the
    set's ``Round`` vector, cleared; ``state.round.start()`` then reduces it."""
    vector = state.round.cleared()
    now = time.monotonic()
    bits = []
    for request in state.pending.values():
        bit = state.cache.bit_for(request)
        if bit is None:
            need_full = True
        else:
            bits.append(bit)
        if report_after is not None and not request.stall_reported and (
                now - request.submitted_at > report_after):
            request.stall_reported = True
            need_full = True
    state.cache.set_bits(bits, vector, 1)
    vector[0] = (0 if need_full else NO_FULL_ROUND) | (RANK_IDLE if idle else 0)
    return vector
