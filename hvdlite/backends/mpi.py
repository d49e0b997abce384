"""MPI's own collectives on the (persistent) fusion buffer."""
from __future__ import annotations

from typing import Sequence

import numpy as np
from mpi4py import MPI

from hvdlite.reduce_op import ReduceOp

MPI_OPS = {ReduceOp.SUM: MPI.SUM, ReduceOp.AVERAGE: MPI.SUM, ReduceOp.MIN: MPI.MIN,
           ReduceOp.MAX: MPI.MAX, ReduceOp.PRODUCT: MPI.PROD}


class MpiBackend:
    name = "mpi"

    def allreduce(self, comm: MPI.Comm, buf: np.ndarray, op: ReduceOp) -> None:
        if comm.Get_size() > 1 and buf.size:
            comm.Allreduce(MPI.IN_PLACE, buf, op=MPI_OPS[op])

    def reducescatter(self, comm: MPI.Comm, buf: np.ndarray, counts: Sequence[int],
                      out: np.ndarray, op: ReduceOp) -> None:
        if comm.Get_size() == 1:
            out[...] = buf[: counts[0]]
            return
        comm.Reduce_scatter(buf, out, recvcounts=list(counts), op=MPI_OPS[op])
