"""Rank layout: local (same node) and cross (same local rank) groups of the transport.

The rule, in order:
1. If the launcher states node identity and every rank can trust it, it wins:
   SLURM's ``SLURM_NODEID``/``SLURM_LOCALID`` are used when, on every rank,
   ``SLURM_PROCID`` equals the MPI rank and ``SLURM_NTASKS`` the MPI size (that
   is, srun started each rank itself). This is what tells apart several slurmd
   "nodes" on one host. Under ``mpirun`` inside an allocation these variables
   describe the batch step, not the ranks, and fail the check.
2. Otherwise ranks that share memory are one node: ``Transport.split_node``
   (MPI: ``Split_type(COMM_TYPE_SHARED)``).
local_rank orders a node's ranks by global rank; cross_rank orders the nodes
by their lowest global rank.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Mapping, Optional

from hvdlite.transport.base import Transport


@dataclasses.dataclass(frozen=True)
class Topology:
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    is_homogeneous: bool
    source: str   # "slurm" or "shared-memory"


def slurm_view(rank: int, size: int, environ: Mapping[str, str]) -> Optional[tuple[int, int]]:
    """(node id, local id) from SLURM if it describes this very rank, else None."""
    try:
        procid = int(environ["SLURM_PROCID"])
        ntasks = int(environ.get("SLURM_NTASKS", environ.get("SLURM_NPROCS", "-1")))
        node, local = int(environ["SLURM_NODEID"]), int(environ["SLURM_LOCALID"])
    except (KeyError, ValueError):
        return None
    return (node, local) if procid == rank and ntasks == size else None


def detect(comm: Transport, environ: Optional[Mapping[str, str]] = None) -> Topology:
    """Collective over ``comm``: every rank must call it."""
    environ = os.environ if environ is None else environ
    rank, size = comm.rank, comm.size
    view = slurm_view(rank, size, environ)
    views = comm.allgather(view)
    trusted = all(v is not None for v in views) and len(set(views)) == size
    if trusted:
        local = comm.split(view[0], key=rank)
        source = "slurm"
    else:
        local = comm.split_node(key=rank)
        source = "shared-memory"
    assert local is not None    # every rank passed a color
    local_rank, local_size = local.rank, local.size
    cross = comm.split(local_rank, key=rank)
    assert cross is not None
    cross_rank, cross_size = cross.rank, cross.size
    homogeneous = len(set(comm.allgather(local_size))) == 1
    local.free()
    cross.free()
    return Topology(rank, size, local_rank, local_size, cross_rank, cross_size,
                    homogeneous, source)


def device_for_local_rank(local_rank: int, local_size: int,
                          visible: Optional[str], present: Optional[int] = None) -> int:
    """The GPU index (as the process sees it) for a local rank.

    ``visible`` is CUDA_VISIBLE_DEVICES. When the scheduler already gave each rank
    its own GPU (one visible device), that is device 0. Otherwise ranks take the
    visible devices in local-rank order, sharing round-robin if there are fewer
    devices than local ranks. Indices are relative to the visible list, which is
    how CUDA numbers them. Without CUDA_VISIBLE_DEVICES, ``present`` (the GPUs the
    driver reports) is the list.
    """
    listed = [d for d in visible.split(",") if d.strip()] if visible is not None else []
    # A list of no devices ("", or only commas) hides them all, as "-1" does.
    if visible is not None and (not listed or visible.strip() in ("-1", "NoDevFiles")):
        raise ValueError("CUDA_VISIBLE_DEVICES hides every GPU from this rank")
    if visible:
        count = len(listed)
    else:       # no mask: the GPUs the driver reports, else assume one per local rank
        count = present or local_size
    return 0 if count == 1 else local_rank % count
