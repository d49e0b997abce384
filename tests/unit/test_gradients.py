"""The gradient bookkeeping shared by every framework's optimizer, without MPI:
how parameters are split into groups, and when a group is due for reduction."""
from __future__ import annotations

import pytest

import hvdlite as hvd
from hvdlite.api.compression import Compression
from hvdlite.api.gradients import GradientReducer, plan_groups
from hvdlite.errors import UsageError


@pytest.mark.parametrize("keys, groups, sizes", [
    (list("abcdefg"), 3, [3, 3, 1]),      # ceil(7 / 3) consecutive keys per group
    (list("abcdef"), 3, [2, 2, 2]),
    (list("abcdef"), 1, [6]),
    (list("abc"), 5, [1, 1, 1]),          # more groups than keys: one key each
    (list("abcdefgh"), 3, [3, 3, 2]),
])
def test_a_number_of_groups_splits_consecutive_keys(keys: list, groups: int,
                                                     sizes: list) -> None:
    group_of, members = plan_groups(keys, groups)
    assert [len(m) for m in members] == sizes
    assert [k for m in members for k in m] == keys
    assert all(group_of[k] == g for g, m in enumerate(members) for k in m)


@pytest.mark.parametrize("groups", [0, -1])
def test_no_positive_number_of_groups_is_refused(groups: int) -> None:
    with pytest.raises(UsageError, match="positive number of groups"):
        plan_groups(list("abc"), groups)


def test_explicit_groups_are_mapped_by_key_and_none_means_no_groups() -> None:
    group_of, members = plan_groups(["x", "y", "z"], [["Y", "X"], ["Z"]], key_of=str.lower)
    assert members == [["y", "x"], ["z"]] and group_of == {"y": 0, "x": 0, "z": 1}
    assert plan_groups(["x"], None) == ({}, [])


def _reducer(groups: object, passes: int = 1) -> GradientReducer:
    keys = list("abcde")
    ops = {"allreduce_async_": None, "synchronize": None}
    return GradientReducer(ops, {k: k for k in keys}, Compression.none, passes, hvd.Average,
                           1.0, None, plan_groups(keys, groups))


def test_a_group_is_due_when_its_last_member_is_ready() -> None:
    reducer = _reducer(2)                 # groups [a, b, c] and [d, e]
    assert reducer.ready("a") == [] and reducer.ready("c") == []
    assert reducer.ready("d") == []
    assert reducer.ready("b") == ["a", "b", "c"]
    assert reducer.ready("e") == ["d", "e"]
    ungrouped = _reducer(None)
    assert ungrouped.ready("b") == ["b"]  # no groups: each key as it is ready


def test_with_several_passes_a_key_counts_once_it_has_them_all() -> None:
    reducer = _reducer(1, passes=2)       # one group of all five
    for key in "abcd":
        assert reducer.ready(key) == []   # first pass
        assert reducer.ready(key) == []   # second: ready, the group is not complete
    assert reducer.ready("e") == []
    assert reducer.ready("e") == list("abcde")
    reducer.reset()
    assert reducer.ready("a") == []       # a new step counts from zero


class _FourRanks:
    def size(self) -> int:
        return 4


@pytest.mark.parametrize("predivide, expected", [
    (1.0, (hvd.Average, 1.0, 1.0)),                    # nothing to split
    (4.0, (hvd.Sum, 0.25, 1.0)),                       # divide by 4 before, by size/4 after
    (0.5, (hvd.Sum, 2.0, 0.125)),                      # a factor below 1 is split too
])
def test_a_predivide_factor_splits_average_around_the_sum(predivide: float,
                                                          expected: tuple) -> None:
    from hvdlite.api.gradients import scaled_op
    op, prescale, postscale = scaled_op(hvd.Average, predivide, _FourRanks())
    assert (int(op), prescale, postscale) == (int(expected[0]), expected[1], expected[2])
