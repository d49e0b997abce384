"""``hvd.ProcessSet(comm)`` with an mpi4py communicator, as Horovod's
test_process_sets_multi_comm.py builds them: the set's ranks are the communicator's
members in the world hvdlite runs on, and such a set is registered and reduced over like
one built from ranks. (Under torchrun a communicator is refused:
tests/unit/test_horovod_names.py.)"""
from __future__ import annotations

import numpy as np
import pytest

import hvdlite as hvd
from tests.mpi.outcomes import under_torchrun

pytestmark = pytest.mark.skipif(under_torchrun(), reason="MPI communicators need MPI ranks")


def test_a_split_communicator_holds_its_members_world_ranks() -> None:
    from mpi4py import MPI
    rank, size = hvd.rank(), hvd.size()
    halves = MPI.COMM_WORLD.Split(color=rank % 2, key=size - rank)   # reversed order inside
    try:
        own = hvd.ProcessSet(halves)
        assert own.ranks == list(range(rank % 2, size, 2)) and own.mpi_comm is halves
        assert own.process_set_id is None
    finally:
        halves.Free()


def test_a_set_from_a_communicator_is_registered_and_reduced_over() -> None:
    from mpi4py import MPI
    rank, size = hvd.rank(), hvd.size()
    first = [0, size - 1] if size > 2 else [0]
    world = MPI.COMM_WORLD.Get_group()
    chosen = world.Incl(first)
    comm = MPI.COMM_WORLD.Create_group(chosen)       # COMM_NULL on the other ranks
    world.Free()
    chosen.Free()
    try:
        if comm == MPI.COMM_NULL:
            with pytest.raises(hvd.UsageError, match="not in the communicator"):
                hvd.ProcessSet(comm)
            added = hvd.add_process_set(first)       # every rank registers the set
        else:
            added = hvd.add_process_set(hvd.ProcessSet(comm))
        assert added.ranks == first
        if rank in first:
            total = hvd.allreduce(np.full(2, rank + 1.0), op=hvd.Sum, name="comm.set",
                                  process_set=added)
            np.testing.assert_array_equal(total, np.full(2, sum(r + 1.0 for r in first)))
        assert hvd.remove_process_set(added)
    finally:
        if comm != MPI.COMM_NULL:
            comm.Free()


def test_neither_ranks_nor_a_communicator_is_a_usage_error() -> None:
    with pytest.raises(hvd.UsageError, match="a list of ranks or an mpi4py communicator"):
        hvd.ProcessSet(3)
