"""The thread level hvdlite asks for when it initialises MPI itself (the program set
mpi4py.rc.initialize = False), and the error for MPI running below what the engine
thread needs. Whole jobs that initialise MPI each way: tests/integration/test_mpi_init.py."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from hvdlite.errors import UsageError
from hvdlite.transport.mpi_init import check_thread_level, requested_level

LEVELS = {"single": 0, "funneled": 1, "serialized": 2, "multiple": 3}


@pytest.mark.parametrize("threads,level,asked", [
    (True, "multiple", "multiple"),        # mpi4py's default
    (True, "serialized", "serialized"),
    (True, "Funneled", "serialized"),      # below what the engine needs: raised
    (True, "single", "serialized"),
    (False, "multiple", "serialized"),     # rc.threads = False asks for single
    (True, "bogus", "multiple"),           # mpi4py would refuse it: its default
])
def test_the_level_asked_for_is_mpi4pys_raised_to_serialized(threads: bool, level: str,
                                                              asked: str) -> None:
    assert requested_level(SimpleNamespace(threads=threads, thread_level=level)) == asked


@pytest.mark.parametrize("provided", [2, 3])
def test_serialized_and_multiple_are_enough(provided: int) -> None:
    check_thread_level(provided, LEVELS, 0)


@pytest.mark.parametrize("provided,name", [(0, "single"), (1, "funneled")])
def test_a_lower_level_is_refused_naming_it_and_the_fix(provided: int, name: str) -> None:
    with pytest.raises(UsageError, match=f"rank 5: MPI runs at thread level '{name}'.*"
                                         r"MPI.Init_thread\(MPI.THREAD_MULTIPLE\)"):
        check_thread_level(provided, LEVELS, 5)
