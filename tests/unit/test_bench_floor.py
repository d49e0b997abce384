"""The lone-op floor of the allreduce benchmark runs and stops its helper thread."""
from __future__ import annotations

import threading
from typing import Callable

import pytest
from mpi4py import MPI

from bench.floor import ROUND_WORDS, handoff_floor, lone_median, negotiated_floor


@pytest.mark.timeout(30)
@pytest.mark.parametrize("floor_of", [handoff_floor, negotiated_floor])
def test_a_floor_times_its_handed_off_work_and_leaves_no_thread(floor_of: Callable) -> None:
    before = threading.active_count()
    floor = floor_of(MPI.COMM_SELF, repeats=5, idle_s=0.0)
    assert 0.0 < floor < 1.0
    assert threading.active_count() == before


def test_the_negotiated_round_is_as_wide_as_the_engines_at_the_default_capacity() -> None:
    assert ROUND_WORDS == 17        # a flag word and 1024 bits


def test_lone_median_is_the_median_of_the_calls() -> None:
    calls = []
    assert lone_median(MPI.COMM_SELF, lambda: calls.append(1), 3, 0.0) >= 0.0
    assert len(calls) == 3
