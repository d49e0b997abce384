"""The lone-op floor of the allreduce benchmark runs and stops its helper thread."""
from __future__ import annotations

import threading

import pytest
from mpi4py import MPI

from hvdlite.bench.floor import ROUND_WORDS, handoff_floor, lone_median, negotiated_floor


@pytest.mark.timeout(30)
def test_the_floor_times_a_handed_off_allreduce_and_leaves_no_thread() -> None:
    before = threading.active_count()
    floor = handoff_floor(MPI.COMM_SELF, repeats=5, idle_s=0.0)
    assert 0.0 < floor < 1.0
    assert threading.active_count() == before


@pytest.mark.timeout(30)
def test_the_negotiated_floor_agrees_then_reduces_and_leaves_no_thread() -> None:
    before = threading.active_count()
    floor = negotiated_floor(MPI.COMM_SELF, repeats=5, idle_s=0.0)
    assert 0.0 < floor < 1.0
    assert threading.active_count() == before
    assert ROUND_WORDS == 17        # hvdlite's round at the default cache capacity


def test_lone_median_is_the_median_of_the_calls() -> None:
    calls = []
    assert lone_median(MPI.COMM_SELF, lambda: calls.append(1), 3, 0.0) >= 0.0
    assert len(calls) == 3
