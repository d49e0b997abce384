"""The process-set registry and a set's round vector, without MPI: ids, who is a
member, what opens and closes, what fails when a set goes away, and the bits and
flag a rank contributes to a negotiation round."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Optional

import pytest
from mpi4py import MPI

from hvdlite.failure.deadlock import BLOCKED, NO_DEADLOCK_CHECK
from hvdlite.failure.waiting import all_done
from hvdlite.negotiation import process_sets as registry_module
from hvdlite.negotiation.cache import ResponseCache
from hvdlite.negotiation.process_sets import (GLOBAL_SET_ID, NO_FULL_ROUND, RANK_IDLE,
                                              ProcessSetRegistry, Round, SetState, round_vector)
from hvdlite.negotiation.requests import Descriptor, Kind, Request, Response
from hvdlite.transport.mpi_transport import MpiRound, MpiTransport


class FakeComm:
    """One rank's transport: dup and split as MPI's would answer on this rank, given
    the global ranks of the set being split (``members``, set by the test)."""

    def __init__(self, rank: int, size: int, log: list) -> None:
        self.rank, self.size, self.log = rank, size, log
        self.members: tuple[int, ...] = ()
        self.freed = False

    def dup(self) -> "FakeComm":
        self.log.append(("dup",))
        return FakeComm(self.rank, self.size, self.log)

    def split(self, color: Optional[int], key: int) -> Optional["FakeComm"]:
        self.log.append(("split", color, key))
        if color is None:
            return None
        return FakeComm(sorted(self.members).index(self.rank), len(self.members), self.log)

    def band_round(self, vector: Any) -> Any:
        return SimpleNamespace(start=lambda: None, free=lambda: None)

    def free(self) -> None:
        self.freed = True


class Registry:
    """A registry on one rank of a world, recording opens and closes."""

    def __init__(self, rank: int, size: int, capacity: int = 16) -> None:
        self.log: list = []
        self.world = FakeComm(rank, size, self.log)
        self.opened: list[tuple[int, Any]] = []
        self.closed: list[int] = []
        self.sets = ProcessSetRegistry(capacity, lambda i, c: self.opened.append((i, c)),
                                       self.closed.append)

    def add(self, ranks: tuple[int, ...]) -> int:
        self.world.members = ranks
        return self.sets.add(ranks, self.world)


def request(name: str) -> Request:
    return Request(Descriptor(name=name, kind=Kind.ALLREDUCE, dtype="float32", shape=(4,)), 0)


def test_the_global_set_is_id_0_on_a_duplicate_of_the_world() -> None:
    for rank in (0, 2):
        r = Registry(rank, 3, capacity=5)
        assert r.add((0, 1, 2)) == GLOBAL_SET_ID == 0
        assert r.log == [("dup",)]
        state = r.sets.member(0)
        assert state is not None and r.opened == [(0, state.comm)]
        assert state.comm is not r.world and state.comm.size == 3
        assert (state.set_id, state.ranks, state.pending) == (0, (0, 1, 2), {})
        assert state.cache.capacity == 5
        # Only the set's rank 0 coordinates, for all the set's ranks.
        assert (state.coordinator is not None) == (rank == 0)
        if rank == 0:
            assert state.coordinator.size == 3  # type: ignore[union-attr]


def test_a_set_splits_the_world_and_its_first_member_coordinates() -> None:
    r = Registry(2, 4)
    r.add((0, 1, 2, 3))
    assert r.add((2, 3)) == 1
    assert r.log[-1] == ("split", 0, 2)               # ordered by world rank
    state = r.sets.member(1)
    assert state is not None and state.comm.size == 2
    assert state.coordinator is not None and state.coordinator.size == 2
    assert r.add((1, 2)) == 2
    state = r.sets.member(2)
    assert state is not None and state.coordinator is None   # set rank 1
    assert [i for i, _ in r.opened] == [0, 1, 2]


def test_a_set_this_rank_is_not_in_is_known_but_not_joined() -> None:
    r = Registry(0, 4)
    r.add((0, 1, 2, 3))
    assert r.add((1, 3)) == 1
    assert r.log[-1] == ("split", None, 0)
    assert r.sets.member(1) is None and r.sets.ranks_of(1) == (1, 3)
    assert r.sets.id_of([1, 3]) == 1 and r.sets.id_of((3, 1)) is None
    assert [i for i, _ in r.opened] == [0]
    assert [s.set_id for s in r.sets.members()] == [0]
    assert r.sets.remove(1, fail=pytest.fail)           # known, so removed; nothing to close
    assert r.closed == [] and r.sets.ranks_of(1) is None


def test_members_are_in_id_order_and_ids_are_never_reused() -> None:
    r = Registry(1, 4)
    for ranks in ((0, 1, 2, 3), (1, 2), (0, 1), (1, 3)):
        r.add(ranks)
    assert [s.set_id for s in r.sets.members()] == [0, 1, 2, 3]
    assert r.sets.remove(2, fail=pytest.fail)
    assert [s.set_id for s in r.sets.members()] == [0, 1, 3]
    assert r.sets.id_of((0, 1)) is None and r.sets.member(2) is None
    assert r.add((0, 1)) == 4                           # the same ranks get a new id
    assert [s.set_id for s in r.sets.members()] == [0, 1, 3, 4]
    assert r.sets.id_of((0, 1)) == 4 and r.sets.ranks_of(4) == (0, 1)


def test_removing_a_set_fails_its_pending_requests_and_frees_it() -> None:
    r = Registry(0, 2)
    r.add((0, 1))
    r.add((0, 1))
    state = r.sets.member(1)
    assert state is not None
    pending = [request("a"), request("b")]
    state.pending.update({q.desc.name: q for q in pending})
    failed: list[Request] = []
    assert r.sets.remove(1, failed.append)
    assert failed == pending and state.pending == {}
    assert r.closed == [1] and state.comm.freed
    assert r.sets.ranks_of(1) is None and r.sets.member(1) is None
    assert not r.sets.remove(1, failed.append)          # twice: unknown
    assert not r.sets.remove(7, failed.append)          # never added
    assert r.closed == [1] and len(failed) == 2


def test_the_global_set_cannot_be_removed() -> None:
    r = Registry(0, 2)
    r.add((0, 1))
    assert not r.sets.remove(GLOBAL_SET_ID, fail=pytest.fail)
    assert r.sets.member(0) is not None and r.sets.ranks_of(0) == (0, 1) and r.closed == []


def test_close_all_closes_every_set_of_this_rank_in_id_order() -> None:
    r = Registry(1, 3)
    for ranks in ((0, 1, 2), (1, 2), (0, 2), (0, 1)):
        r.add(ranks)
    r.sets.close_all()
    assert r.closed == [0, 1, 3]


# -- round vectors ----------------------------------------------------------------------------

def set_state(cached: list[str], capacity: int = 130) -> SetState:
    cache = ResponseCache(capacity)
    for name in cached:
        desc = request(name).desc
        cache.insert(Response(desc), desc)
    return SetState(1, (0, 1), FakeComm(0, 2, []), cache, None)  # type: ignore[arg-type]


def expected(state: SetState, names: list[str], no_full_round: bool) -> list[int]:
    vector = [0] * (1 + state.cache.words)
    vector[0] = int(NO_FULL_ROUND) if no_full_round else 0
    for name in names:
        bit = state.cache.lookup(request(name).desc)
        assert bit is not None
        vector[1 + bit // 64] |= 1 << (bit % 64)
    return vector


@pytest.fixture
def now(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    clock = [12.0]                  # small times: a pending time is a difference, not a ratio
    monkeypatch.setattr(registry_module, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    return clock


def pend(state: SetState, name: str, submitted_at: Optional[float] = None) -> Request:
    state.pending[name] = r = request(name)
    if submitted_at is not None:
        r.submitted_at = submitted_at
    return r


def plain(vector: Any) -> list[int]:
    return vector.tolist()


def test_all_cached_needs_no_full_round(now: list[float]) -> None:
    names = [f"t{i}" for i in range(70)]              # bits in two words
    state = set_state(names)
    for name in ("t0", "t5", "t64", "t69"):
        pend(state, name)
    vector = round_vector(state, False, None)
    assert vector.itemsize == 8 and len(vector) == 1 + state.cache.words == 4
    assert plain(vector) == expected(state, ["t0", "t5", "t64", "t69"], True)
    # The engine may need a full round anyway (a shutdown, a join): the flag says so.
    assert plain(round_vector(state, True, None)) == expected(
        state, ["t0", "t5", "t64", "t69"], False)


def test_an_uncached_request_needs_a_full_round(now: list[float]) -> None:
    state = set_state(["a", "b"])
    pend(state, "a")
    pend(state, "new")
    pend(state, "b")
    assert plain(round_vector(state, False, None)) == expected(state, ["a", "b"], False)
    assert round_vector(set_state([]), False, None).tolist()[0] == int(NO_FULL_ROUND)


def test_an_idle_rank_says_so_in_the_flag_word_beside_the_full_round_flag(
        now: list[float]) -> None:
    """RANK_IDLE is a separate bit: set only when asked, whatever the full-round flag
    says, and never touching the cache bits after the flag word."""
    empty = set_state([])
    assert plain(round_vector(empty, False, None, idle=True))[0] == NO_FULL_ROUND | RANK_IDLE
    assert plain(round_vector(empty, True, None, idle=True))[0] == RANK_IDLE
    assert plain(round_vector(empty, False, None))[0] == NO_FULL_ROUND     # cleared again
    assert RANK_IDLE & NO_FULL_ROUND == 0
    state = set_state(["a", "b"])
    pend(state, "b")
    with_flag = plain(round_vector(state, False, None, idle=True))
    assert with_flag[1:] == expected(state, ["b"], True)[1:]


def test_a_request_pending_too_long_needs_one_full_round(now: list[float]) -> None:
    state = set_state(["a", "b"])
    old = pend(state, "a", submitted_at=now[0] - 10.0)
    young = pend(state, "b", submitted_at=now[0] - 4.0)
    assert plain(round_vector(state, False, None))[0] == int(NO_FULL_ROUND)  # no inspection
    assert not old.stall_reported
    vector = round_vector(state, False, 5.0)
    assert plain(vector) == expected(state, ["a", "b"], False)
    assert old.stall_reported and not young.stall_reported
    assert plain(round_vector(state, False, 5.0))[0] == int(NO_FULL_ROUND)  # once only
    now[0] += 1.0                                      # "b" has now waited exactly 5 s
    assert plain(round_vector(state, False, 5.0))[0] == int(NO_FULL_ROUND)
    now[0] += 0.5
    assert plain(round_vector(state, False, 5.0))[0] == 0
    assert young.stall_reported


def test_the_flag_bits_of_the_registry_and_the_deadlock_watch_are_distinct() -> None:
    flags = [NO_FULL_ROUND, RANK_IDLE, BLOCKED, NO_DEADLOCK_CHECK]
    assert all(f > 0 and f & (f - 1) == 0 for f in flags)      # one bit each
    assert NO_FULL_ROUND | RANK_IDLE | BLOCKED | NO_DEADLOCK_CHECK == sum(flags)  # none shared


def test_a_round_is_started_again_and_again_on_its_own_vector() -> None:
    """One rank: the persistent round (MPI-4 ``Allreduce_init``, as the MPICH and Open MPI
    wheels provide) reduces its vector in place each time it is started, and
    ``round_vector`` clears and fills that same vector for the next round."""
    comm = MpiTransport(MPI.COMM_SELF.Dup())
    state = set_state(["a", "b"])
    state.comm, state.round = comm, Round(comm, 1 + state.cache.words)
    try:
        for names in (["a", "b"], ["b"], []):
            state.pending.clear()
            for name in names:
                pend(state, name)
            vector = round_vector(state, False, None)
            assert vector is state.round.vector
            request = state.round.start()
            while not all_done([request]):
                pass
            assert vector.tolist() == expected(state, names, True)   # a BAND over one rank
    finally:
        state.round.free()
        comm.free()


def test_without_persistent_collectives_each_round_posts_an_iallreduce() -> None:
    """A communicator without ``Allreduce_init`` (MPI before 4): each start posts an
    ``Iallreduce`` over the round's vector."""
    posted = []

    class OldComm:
        def Iallreduce(self, send: Any, vector: Any, op: Any) -> str:  # noqa: N802
            posted.append((send, vector, op))
            return "request"
    state = set_state(["a"])
    state.round._band = MpiRound(OldComm(), state.round.vector)  # type: ignore[arg-type]
    state.round.start = state.round._band.start
    pend(state, "a")
    vector = round_vector(state, False, None)
    assert state.round.start() == "request"
    assert posted == [(MPI.IN_PLACE, vector, MPI.BAND)]


def test_all_done_tests_each_request_until_one_is_not() -> None:
    tested = []

    class Request:
        def __init__(self, name: str, done: bool) -> None:
            self.name, self.done = name, done

        def Test(self) -> bool:  # noqa: N802
            tested.append(self.name)
            return self.done
    assert all_done([Request("a", True), Request("b", True)]) and tested == ["a", "b"]
    tested.clear()
    assert not all_done([Request("a", True), Request("b", False), Request("c", True)])
    assert tested == ["a", "b"]
    assert all_done([])


def test_a_registered_set_rounds_over_every_bit_of_its_cache() -> None:
    """The round a set is registered with has room for the flag and every cache bit:
    the last bit of a full cache comes back from a round."""
    registry = ProcessSetRegistry(130, lambda set_id, comm: None, lambda set_id: None)
    registry.add((0,), MpiTransport(MPI.COMM_SELF))
    state = registry.member(GLOBAL_SET_ID)
    assert state is not None
    for i in range(130):
        state.cache.insert(Response(request(f"t{i}").desc), request(f"t{i}").desc)
    pend(state, "t129")
    assert state.cache.bit_for(state.pending["t129"]) == 129
    vector = round_vector(state, False, None)
    request_ = state.round.start()
    while not all_done([request_]):
        pass
    assert ResponseCache.bits_of(vector, 1) == [129]
    state.round.free()
    state.comm.free()
