"""The communicator a benchmark worker times with, on either transport.

Under mpiexec it is a duplicate of MPI's world. Under torchrun there is no MPI world
(every process would be a world of size 1), so the same few calls the timing loops
make (``Get_rank``, ``Get_size``, ``Barrier``, ``bcast``, ``allgather``, and a MAX of
floats) run on a Gloo group of their own, made before ``hvdlite.init()``: hvdlite's
engine thread runs its collectives on the world group, and two threads issuing
collectives on one torch group could interleave them differently on each rank.
"""
from __future__ import annotations

from typing import Any

import numpy as np


class TorchComm:
    """mpi4py's names for the calls the benchmark's timing makes, over one Gloo group."""

    def __init__(self) -> None:
        import torch.distributed as dist
        self._dist = dist
        from hvdlite.transport import torch_transport
        torch_transport.initialize()            # torchrun's variables, over Gloo
        self.group = dist.new_group(backend="gloo")   # every rank, so before hvd.init()

    def Get_rank(self) -> int:  # noqa: N802 (mpi4py's names)
        return self._dist.get_rank(self.group)

    def Get_size(self) -> int:  # noqa: N802
        return self._dist.get_world_size(self.group)

    def Barrier(self) -> None:  # noqa: N802
        self._dist.barrier(group=self.group)

    def bcast(self, obj: Any, root: int = 0) -> Any:
        box = [obj]
        self._dist.broadcast_object_list(box, src=root, group=self.group)
        return box[0]

    def allgather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.Get_size()
        self._dist.all_gather_object(out, obj, group=self.group)
        return out

    def max_array(self, values: np.ndarray) -> None:
        """Elementwise MAX over ranks, in place (float64)."""
        import torch
        tensor = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float64))
        self._dist.all_reduce(tensor, op=self._dist.ReduceOp.MAX, group=self.group)
        values[:] = tensor.numpy()


def under_torchrun() -> bool:
    """Whether hvdlite.init() would open the torch transport here (it imports nothing)."""
    from hvdlite.transport import choice
    return choice.chosen().name == "torch"


def bench_comm() -> Any:
    """The timing communicator for this launch: torchrun's (Gloo) or MPI's."""
    if under_torchrun():
        return TorchComm()
    from mpi4py import MPI
    return MPI.COMM_WORLD.Dup()


def slowest(comm: Any, values: np.ndarray) -> None:
    """Each entry's largest value over the ranks of ``comm``, in place, on either kind."""
    if isinstance(comm, TorchComm):
        comm.max_array(values)
        return
    from mpi4py import MPI
    comm.Allreduce(MPI.IN_PLACE, values, op=MPI.MAX)
