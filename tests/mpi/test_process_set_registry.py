"""The engine's process-set registry: ids are never reused, a set can be removed
and re-added with the same ranks many times (also after a failed collective on
it), and settings change by a negotiated reconfiguration."""
from __future__ import annotations

import time

import numpy as np
import pytest

import hvdlite as hvd
from hvdlite.api import runtime
from hvdlite.api.control import reconfigure
from hvdlite.failure import waiting
from tests.mpi.outcomes import channel


def _sum_on(process_set: hvd.ProcessSet, tag: str) -> None:
    if process_set.included():
        result = hvd.allreduce(np.ones(2), op=hvd.Sum, name=tag, process_set=process_set)
        np.testing.assert_array_equal(result, np.full(2, float(process_set.size())))


def test_remove_and_re_add_the_same_ranks_many_times() -> None:
    ranks = list(range(0, hvd.size(), 2))        # even ranks: a real subset from np=3 on
    seen_ids = set()
    for round_ in range(25):
        process_set = hvd.add_process_set(hvd.ProcessSet(ranks))
        assert process_set.process_set_id not in seen_ids
        seen_ids.add(process_set.process_set_id)
        _sum_on(process_set, f"readd.{round_}")
        assert hvd.remove_process_set(process_set)
        assert not hvd.remove_process_set(process_set)
    with pytest.raises(hvd.UsageError, match="not registered"):
        hvd.allreduce(np.ones(1), process_set=process_set)


def test_re_add_after_a_failed_collective_on_the_set() -> None:
    ranks = list(range(hvd.size()))[::-1][: max(1, hvd.size() - 1)]
    for round_ in range(5):
        process_set = hvd.add_process_set(ranks)
        if process_set.included():
            shape = (3,) if process_set.rank() == 0 else (4,)
            expect = hvd.MismatchError if process_set.size() > 1 else None
            if expect:
                with pytest.raises(expect, match="shape"):
                    hvd.allreduce(np.ones(shape), name=f"bad.{round_}", process_set=process_set)
        _sum_on(process_set, f"after.bad.{round_}")
        hvd.remove_process_set(process_set)
    result = hvd.allreduce(np.ones(1), op=hvd.Sum, name="registry.global.ok")
    assert result[0] == hvd.size()


def test_reconfigure_switches_every_rank_and_rejects_disagreement() -> None:
    before = runtime.config().allreduce
    reconfigure(allreduce="ring")
    assert runtime.config().allreduce == "ring"
    data = np.arange(1 << 16, dtype=np.float32)
    np.testing.assert_array_equal(hvd.allreduce(data, op=hvd.Sum, name="reconf.ring"),
                                  data * hvd.size())
    reconfigure(allreduce=before)
    if hvd.size() > 1:
        choice = "mpi" if hvd.rank() == 0 else "ring"
        with pytest.raises(hvd.MismatchError, match="settings"):
            reconfigure(allreduce=choice)
        assert runtime.config().allreduce == before
    with pytest.raises(hvd.ConfigError):
        reconfigure(no_such_setting=1)


def test_a_set_keeps_going_while_a_non_member_idles(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every rank joins the global set's rounds, so ops on a smaller set wait for an
    idle non-member's next tick. While a member's word says it is busy, that rank
    ticks every cycle instead of backing off to 64 cycles. The backed-off tick is made
    long here (64 cycles, 0.64 s, not 0.1 s), so that the two are far apart on a busy
    machine too: after a first op (which may meet a backed-off tick), 12 ops at a 10 ms
    cycle take about a cycle each, and at most 20 (0.2 s) where a busy machine slows
    them; ticks that backed off would take up to 0.64 s."""
    if hvd.size() < 2:
        pytest.skip("needs a rank outside the set")
    monkeypatch.setattr(waiting.IdleTicks, "LONGEST_BACKOFF_S", 2.0)
    members = list(range(hvd.size() - 1))        # all but the last rank, which idles
    process_set = hvd.add_process_set(members)
    cycle_s, ops = 0.010, 12
    before = runtime.config().cycle_time
    reconfigure(cycle_time=cycle_s * 1e3)
    per_op = 0.0
    try:
        if process_set.included():
            _sum_on(process_set, "idle.peer.first")
            started = time.perf_counter()
            for i in range(ops):
                _sum_on(process_set, f"idle.peer.{i}")
            per_op = (time.perf_counter() - started) / ops
        channel().idle_until_all_arrive()   # the idle rank waits here, outside hvdlite
    finally:
        reconfigure(cycle_time=before)
        hvd.remove_process_set(process_set)
    assert per_op < 20 * cycle_s, (
        f"rank {hvd.rank()}: {per_op * 1e3:.0f} ms an op on set {members} while rank "
        f"{hvd.size() - 1} idled; the cycle is {cycle_s * 1e3:.0f} ms")
