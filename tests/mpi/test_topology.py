"""init() is idempotent; the SLURM topology rule under real communicators."""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

import hvdlite as hvd
from hvdlite.transport.mpi_transport import MpiTransport
from hvdlite.transport.topology import detect


def test_second_init_is_harmless() -> None:
    before = (hvd.rank(), hvd.size(), hvd.local_rank())
    hvd.init()
    assert (hvd.rank(), hvd.size(), hvd.local_rank()) == before
    np.testing.assert_array_equal(hvd.allreduce(np.ones(1), op=hvd.Sum, name="reinit"),
                                  [float(hvd.size())])


def _fake_slurm(rank: int, size: int, nodes: int) -> dict[str, str]:
    """srun's view of ``size`` tasks spread block-wise over ``nodes`` nodes."""
    per_node = -(-size // nodes)
    return {"SLURM_PROCID": str(rank), "SLURM_NTASKS": str(size),
            "SLURM_NODEID": str(rank // per_node), "SLURM_LOCALID": str(rank % per_node)}


def test_slurm_node_identity_wins_when_it_describes_every_rank() -> None:
    comm = MpiTransport(MPI.COMM_WORLD.Dup())
    rank, size = comm.rank, comm.size
    nodes = 2 if size > 1 else 1
    topo = detect(comm, _fake_slurm(rank, size, nodes))
    per_node = -(-size // nodes)
    assert topo.source == "slurm"
    assert (topo.local_rank, topo.cross_rank) == (rank % per_node, rank // per_node)
    assert topo.cross_size == nodes and topo.local_size == per_node
    comm.free()


def test_slurm_variables_of_a_batch_step_are_ignored() -> None:
    """mpirun inside an allocation: every rank sees the batch step's SLURM_PROCID=0,
    which is not its MPI rank, so shared memory decides (one node here)."""
    comm = MpiTransport(MPI.COMM_WORLD.Dup())
    batch_step = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_NODEID": "0",
                  "SLURM_LOCALID": "0"}
    topo = detect(comm, batch_step)
    assert topo.source == "shared-memory"
    assert topo.local_rank == comm.rank and topo.local_size == comm.size
    assert topo.cross_size == 1
    comm.free()
