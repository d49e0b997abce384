"""Every collective against join(), at any size: on the global set, and (from three
ranks on) on a process set of two that holds the joined rank, while a set without it
runs as usual.

Horovod's pattern: each rank in turn joins first while the others call a collective,
then join too. A collective join() cannot stand in for fails with JoinError on every
rank that called it; unnamed calls count differently on each rank (the joined rank
skips one), which from three ranks on left the callers waiting on names no other
rank would ever submit. An allreduce runs, the joined rank contributing the op's
identity (zeros for Sum, so that Min, Max and Product cover the ranks that still
have data).

Assertions come after every rank's last collective: a rank failing earlier would
leave the others waiting in it.
"""
from __future__ import annotations

import re
from typing import Any, Callable, Iterator, Optional

import numpy as np
import pytest

import hvdlite as hvd

pytestmark = pytest.mark.timeout(60)

Sets = dict[tuple[int, ...], hvd.ProcessSet]
Call = Callable[[Optional[hvd.ProcessSet], list[int], int], Any]   # (set, its ranks, joined)


def _pair(joined: int) -> tuple[int, ...]:
    return tuple(sorted({joined, (joined + 1) % hvd.size()}))


def _without(joined: int) -> tuple[int, ...]:
    return tuple(r for r in range(hvd.size()) if r != joined)


@pytest.fixture(scope="module")
def sets() -> Iterator[Sets]:
    """From three ranks on, for each rank j: the pair (j, j + 1 mod size) and the set
    of every rank but j (at two ranks the pair is the global set)."""
    made: Sets = {}
    if hvd.size() >= 3:
        for joined in range(hvd.size()):
            for ranks in (_pair(joined), _without(joined)):
                if ranks not in made:
                    made[ranks] = hvd.add_process_set(hvd.ProcessSet(list(ranks)))
    yield made
    for process_set in made.values():
        hvd.remove_process_set(process_set)


def _places() -> list[str]:
    return ["global"] + (["set"] if hvd.size() >= 3 else [])


def _turns(call: Call, sets: Sets, tag: str, places: Optional[list[str]] = None,
           ) -> tuple[list, list, list]:
    """For each rank j in turn, on the global set and then (three ranks and more) on
    j's pair: j joins; the set's other members run ``call`` (its result or error
    recorded, with where and j), and on a pair every rank but j also allgathers on
    the set without j; then every rank joins. Returns (outcomes, gathers, join()'s
    value per turn)."""
    outcomes, gathers, lasts = [], [], []
    for where in places or _places():
        for joined in range(hvd.size()):
            process_set = sets[_pair(joined)] if where == "set" else None
            members = list(_pair(joined)) if where == "set" else list(range(hvd.size()))
            if hvd.rank() != joined and hvd.rank() in members:
                try:
                    outcomes.append((where, joined, call(process_set, members, joined)))
                except hvd.HvdliteError as error:
                    outcomes.append((where, joined, error))
            if where == "set" and hvd.rank() != joined:
                gathers.append((joined, hvd.allgather(
                    np.full((1, 2), hvd.rank()), process_set=sets[_without(joined)],
                    name=f"join.without.{tag}.{joined}")))
            lasts.append((where, joined, hvd.join()))
    return outcomes, gathers, lasts


def _after_turns(gathers: list, lasts: list, tag: str) -> Callable[[], None]:
    """Run the collectives that check the turns and return the check: join() named a
    rank other than the one that joined first, the same everywhere; a set without
    the joined rank gathered from all its ranks; an allreduce then worked everywhere."""
    everywhere = hvd.allgather_object(lasts, name=f"join.lasts.{tag}")
    result = hvd.allreduce(np.ones(3), op=hvd.Sum, name=f"join.after.{tag}")

    def check() -> None:
        assert all(last != joined for _, joined, last in lasts), lasts
        assert everywhere == [lasts] * hvd.size(), everywhere
        for joined, gathered in gathers:
            np.testing.assert_array_equal(gathered, np.repeat(_without(joined), 2).reshape(-1, 2))
        np.testing.assert_array_equal(result, np.full(3, float(hvd.size())))
    return check


def _my_turns(where: str) -> list[int]:
    """The turns in which this rank calls on ``where``."""
    members = _pair if where == "set" else (lambda j: range(hvd.size()))
    return [j for j in range(hvd.size()) if j != hvd.rank() and hvd.rank() in members(j)]


# Unnamed, as in Horovod's tests. ``members``: the set's ranks; ``root``: the joined rank.
NOT_WITH_JOIN: dict[str, Call] = {
    "allgather": lambda ps, m, root: hvd.allgather(np.ones((2, 3)), process_set=ps),
    "grouped_allgather": lambda ps, m, root: hvd.grouped_allgather(
        [np.ones((2, 3)), np.ones(2)], process_set=ps),
    "broadcast": lambda ps, m, root: hvd.broadcast(np.ones(3), root_rank=root, process_set=ps),
    "alltoall": lambda ps, m, root: hvd.alltoall(np.ones((2 * len(m), 3)), process_set=ps),
    "reducescatter": lambda ps, m, root: hvd.reducescatter(np.ones((len(m), 2)), process_set=ps),
    "grouped_reducescatter": lambda ps, m, root: hvd.grouped_reducescatter(
        [np.ones((len(m), 2)), np.ones(len(m))], process_set=ps),
    "barrier": lambda ps, m, root: hvd.barrier(process_set=ps),
}


@pytest.mark.parametrize("collective", sorted(NOT_WITH_JOIN))
def test_a_collective_join_cannot_run_fails_on_every_rank_that_called_it(
        collective: str, sets: Sets) -> None:
    outcomes, gathers, lasts = _turns(NOT_WITH_JOIN[collective], sets, collective)
    check_turns = _after_turns(gathers, lasts, collective)
    for where, joined, outcome in outcomes:
        assert isinstance(outcome, hvd.JoinError), (where, joined, outcome)
        # The joined rank is named (and any caller that has joined since, as a rank
        # whose call of a grouped op failed at its first tensor may find).
        named = re.search(r"ranks \[([\d, ]+)\] are in join\(\)", str(outcome))
        assert named and str(joined) in named.group(1).split(", "), str(outcome)
    assert [(w, j) for w, j, _ in outcomes] == [(w, j) for w in _places() for j in _my_turns(w)]
    check_turns()


OPS = {"sum": hvd.Sum, "average": hvd.Average, "min": hvd.Min, "max": hvd.Max,
       "product": hvd.Product, "adasum": hvd.Adasum}


def _data(op: str, rank: int, dtype: type) -> np.ndarray:
    """Values for which a joined rank's zeros would show: positive for Min, negative
    for Max, none zero; for Adasum one coordinate per rank (orthogonal vectors, whose
    Adasum is their sum)."""
    if op == "adasum":
        vector = np.zeros(max(hvd.size(), 2), dtype)
        vector[rank] = rank + 1
        return vector
    values = 1 + (np.arange(6) + rank) % 3
    return (-values if op == "max" else values).astype(dtype)


def _expected(op: str, ranks: list[int], size: int, dtype: type) -> np.ndarray:
    """The reduction over ``ranks`` (the set's ranks but the joined one); Average
    divides by the set's ``size`` (integers truncated toward zero)."""
    arrays = np.array([_data(op, r, dtype) for r in ranks])
    if op in ("sum", "adasum"):
        return arrays.sum(axis=0).astype(dtype)
    if op == "average":
        if np.dtype(dtype).kind == "i":
            return np.trunc(arrays.sum(axis=0) / size).astype(dtype)
        return arrays.sum(axis=0).astype(dtype) / size      # in the dtype, as hvdlite
    reduce = {"min": np.min, "max": np.max, "product": np.prod}[op]
    return reduce(arrays, axis=0).astype(dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.int32], ids=["float32", "int32"])
@pytest.mark.parametrize("op", sorted(OPS))
def test_allreduce_with_a_joined_rank_reduces_the_others(op: str, dtype: type,
                                                         sets: Sets) -> None:
    if op == "adasum" and dtype is np.int32:
        pytest.skip("Adasum reduces floating-point tensors only")
    places = _places()
    if op == "adasum" and hvd.size() & (hvd.size() - 1):
        places.remove("global")      # Adasum needs a set whose size is a power of two

    def reduce(ps: Optional[hvd.ProcessSet], members: list[int], joined: int) -> Any:
        return hvd.allreduce(_data(op, hvd.rank(), dtype), op=OPS[op], process_set=ps,
                             name=f"join.{op}.{ps is None}.{np.dtype(dtype).name}.{joined}")
    tag = f"{op}.{np.dtype(dtype).name}"
    outcomes, gathers, lasts = _turns(reduce, sets, tag, places)
    check_turns = _after_turns(gathers, lasts, tag)
    for where, joined, result in outcomes:
        members = list(_pair(joined)) if where == "set" else list(range(hvd.size()))
        want = _expected(op, [r for r in members if r != joined], len(members), dtype)
        np.testing.assert_array_equal(result, want, err_msg=f"{where}: rank {joined} joined")
    check_turns()


def test_grouped_allreduce_with_a_joined_rank(sets: Sets) -> None:
    """One dtype (bundled into one request) and two dtypes (packed), Sum and Max."""
    def reduce(ps: Optional[hvd.ProcessSet], members: list[int], joined: int) -> Any:
        rank, where = hvd.rank(), ps is None
        one = [_data("sum", rank, np.float64), _data("sum", rank + 1, np.float64)[:4]]
        two = [_data("max", rank, np.float32), _data("max", rank, np.int64)]
        return (hvd.grouped_allreduce(one, op=hvd.Sum, process_set=ps,
                                      name=f"join.grouped.one.{where}.{joined}"),
                hvd.grouped_allreduce(two, op=hvd.Max, process_set=ps,
                                      name=f"join.grouped.two.{where}.{joined}"))
    outcomes, gathers, lasts = _turns(reduce, sets, "grouped")
    check_turns = _after_turns(gathers, lasts, "grouped")
    for where, joined, (one, two) in outcomes:
        members = _pair(joined) if where == "set" else range(hvd.size())
        others = [r for r in members if r != joined]
        np.testing.assert_array_equal(one[0], np.sum([_data("sum", r, np.float64)
                                                      for r in others], axis=0))
        np.testing.assert_array_equal(one[1], np.sum([_data("sum", r + 1, np.float64)[:4]
                                                      for r in others], axis=0))
        np.testing.assert_array_equal(two[0], _expected("max", others, 1, np.float32))
        np.testing.assert_array_equal(two[1], _expected("max", others, 1, np.int64))
    check_turns()
