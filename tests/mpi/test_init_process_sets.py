"""init(process_sets=...) while hvdlite runs (the session's init() came first): a refused
list raises UsageError (a ValueError, as Horovod's) on every rank and registers none of
its sets, so a corrected call works. The same at the first init(), where the refused
call also leaves hvdlite not started: tests/integration/test_mpi_init.py."""
from __future__ import annotations

from typing import Optional

import numpy as np
import pytest

import hvdlite as hvd
from hvdlite.api import runtime

pytestmark = pytest.mark.timeout(60)


def _registered() -> dict[int, tuple[int, ...]]:
    return runtime.engine().registry.registered()


def _refused(sets: list, match: str) -> None:
    """Every rank raises, and nothing changed: no set registered, no id handed out."""
    before = _registered()
    with pytest.raises(ValueError, match=match) as info:
        hvd.init(process_sets=sets)
    assert isinstance(info.value, hvd.UsageError)
    assert f"rank {hvd.rank()}:" in str(info.value)
    assert _registered() == before
    assert all(s.process_set_id is None for s in sets if isinstance(s, hvd.ProcessSet))


def _sum_on(process_set: hvd.ProcessSet, tag: str) -> None:
    if process_set.included():
        result = hvd.allreduce(np.ones(2), op=hvd.Sum, name=tag, process_set=process_set)
        np.testing.assert_array_equal(result, np.full(2, float(process_set.size())))


def _last_ranks() -> hvd.ProcessSet:
    return hvd.ProcessSet(range(1, hvd.size()))


def test_a_duplicate_is_refused_everywhere_and_a_corrected_call_registers_the_sets() -> None:
    first, rest = hvd.ProcessSet([0]), _last_ranks()
    _refused([first, rest, hvd.ProcessSet(reversed(range(hvd.size())))],
             r"entry 2, ranks \[0, .*\], duplicates the global process set")
    _refused([hvd.ProcessSet([0]), _last_ranks(), hvd.ProcessSet([0])],
             r"entry 2, ranks \[0\], duplicates entry 0")
    hvd.init(process_sets=[first, rest])
    try:
        assert _registered()[first.process_set_id] == (0,)
        assert _registered()[rest.process_set_id] == tuple(range(1, hvd.size()))
        _sum_on(first, "init.sets.first")
        _sum_on(rest, "init.sets.rest")
        _refused([hvd.ProcessSet([0])], r"duplicates process set \d+, already registered")
    finally:
        hvd.remove_process_set(first)
        hvd.remove_process_set(rest)


def test_lists_that_differ_between_ranks_are_refused_on_every_rank() -> None:
    last = hvd.size() - 1
    mine = hvd.ProcessSet([0] if hvd.rank() == 0 else [last])
    _refused([mine], rf"rank 0 asked for \[\[0\]\], rank 1 for \[\[{last}\]\]")


def test_one_ranks_unusable_argument_is_reported_on_every_rank() -> None:
    last = hvd.size() - 1
    entry: Optional[object] = [0] if hvd.rank() == last else hvd.ProcessSet([0])
    _refused([entry], rf"refused on some ranks: rank {last}: entry 0 is a list, not a "
                      "ProcessSet")
    _refused([hvd.ProcessSet([hvd.size()])], r"names ranks outside 0\.\.")


def test_dynamic_registers_nothing_and_sets_are_added_later() -> None:
    before = _registered()
    hvd.init(process_sets="dynamic")
    assert _registered() == before
    added = hvd.add_process_set(_last_ranks())
    _sum_on(added, "init.dynamic")
    hvd.remove_process_set(added)
