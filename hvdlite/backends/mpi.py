"""MPI's own collectives, on host buffers: the backend that supports everything
on the CPU and ends every chain."""
from __future__ import annotations

from typing import Sequence

import numpy as np
from mpi4py import MPI

from hvdlite.backends.base import DONE, Buffer, Done, HostBackend, offsets
from hvdlite.reduce_op import ReduceOp

MPI_OPS = {ReduceOp.SUM: MPI.SUM, ReduceOp.AVERAGE: MPI.SUM, ReduceOp.MIN: MPI.MIN,
           ReduceOp.MAX: MPI.MAX, ReduceOp.PRODUCT: MPI.PROD}


class MpiBackend(HostBackend):
    name = "mpi"

    def supports(self, kind: str, dtype: np.dtype, device: str, nbytes: int,
                 op: ReduceOp = ReduceOp.SUM) -> bool:
        return device == "cpu" and op is not ReduceOp.ADASUM

    def allreduce(self, set_id: int, buf: Buffer, op: ReduceOp) -> Done:
        comm = self._comms[set_id]
        if comm.Get_size() > 1 and buf.size:
            comm.Allreduce(MPI.IN_PLACE, buf, op=MPI_OPS[op])
        return DONE

    def allreduce_from(self, set_id: int, source: Buffer, buf: Buffer, op: ReduceOp) -> Done:
        comm = self._comms[set_id]
        if comm.Get_size() > 1 and buf.size:
            comm.Allreduce(source, buf, op=MPI_OPS[op])
        else:
            buf[...] = source
        return DONE

    def allgather(self, set_id: int, send: Buffer, recv: Buffer,
                  counts: Sequence[int]) -> Done:
        self._comms[set_id].Allgatherv([send, MPI.BYTE],
                                       [recv, (list(counts), offsets(counts)), MPI.BYTE])
        return DONE

    def broadcast(self, set_id: int, buf: Buffer, root: int) -> Done:
        self._comms[set_id].Bcast([buf, MPI.BYTE], root=root)
        return DONE

    def alltoall(self, set_id: int, send: Buffer, send_counts: Sequence[int],
                 recv: Buffer, recv_counts: Sequence[int]) -> Done:
        self._comms[set_id].Alltoallv(
            [send, (list(send_counts), offsets(send_counts)), MPI.BYTE],
            [recv, (list(recv_counts), offsets(recv_counts)), MPI.BYTE])
        return DONE

    def reducescatter(self, set_id: int, buf: Buffer, counts: Sequence[int],
                      out: Buffer, op: ReduceOp) -> Done:
        comm = self._comms[set_id]
        if comm.Get_size() == 1:
            out[...] = buf[: counts[0]]
        else:
            comm.Reduce_scatter(buf, out, recvcounts=list(counts), op=MPI_OPS[op])
        return DONE
