"""MPI's own collectives, on host buffers: the backend that supports everything
on the CPU and ends every chain.

Its byte counts are estimates (``Traffic.exact`` is False): MPI picks its own
algorithm per call, which Python cannot see. What is counted is what a
bandwidth-optimal algorithm moves per rank: 2N(P-1)/P each way for an
allreduce of N bytes, N - (own share) for a reduce-scatter and an allgather,
the pairwise bytes of an alltoall, and N received (sent by the root) for a
broadcast.

Each collective is MPI's nonblocking one, waited on in ``waits.wait_all``: on the
engine's thread a peer that stops answering inside it is found and named, where a
blocking call would hang (hvdlite/transport/waits.py). Measured at 2 ranks on an idle
machine, an Iallreduce polled so takes as long as MPI_Allreduce from 4 B to 64 MiB.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
try:
    from mpi4py import MPI
except ImportError:     # no mpi4py (torchrun's transport): these backends decline every call
    MPI = None  # type: ignore[assignment]

from hvdlite.backends.base import DONE, Buffer, Done, HostBackend, offsets
from hvdlite.reduce_op import ReduceOp
from hvdlite.transport.waits import wait_all

MPI_OPS = {ReduceOp.SUM: MPI.SUM, ReduceOp.AVERAGE: MPI.SUM, ReduceOp.MIN: MPI.MIN,
           ReduceOp.MAX: MPI.MAX, ReduceOp.PRODUCT: MPI.PROD} if MPI is not None else {}


class MpiBackend(HostBackend):
    name = "mpi"
    exact_traffic = False

    def supports(self, kind: str, dtype: np.dtype, device: str, nbytes: int,
                 op: ReduceOp = ReduceOp.SUM) -> bool:
        return device == "cpu" and op is not ReduceOp.ADASUM and not self.declined

    def allreduce(self, set_id: int, buf: Buffer, op: ReduceOp) -> Done:
        return self.allreduce_from(set_id, MPI.IN_PLACE, buf, op)

    def allreduce_from(self, set_id: int, source: Any, buf: Buffer, op: ReduceOp) -> Done:
        """``source`` MPI.IN_PLACE reduces ``buf`` in place."""
        comm = self._comms[set_id]
        size = comm.Get_size()
        if size > 1 and buf.size:
            wait_all([comm.Iallreduce(source, buf, op=MPI_OPS[op])])
        elif source is not MPI.IN_PLACE:
            buf[...] = source
        estimate = 2 * buf.nbytes * (size - 1) // size
        self.traffic.add("allreduce", estimate, estimate)
        return DONE

    def allgather(self, set_id: int, send: Buffer, recv: Buffer,
                  counts: Sequence[int]) -> Done:
        wait_all([self._comms[set_id].Iallgatherv(
            [send, MPI.BYTE], [recv, (list(counts), offsets(counts)), MPI.BYTE])])
        others = sum(counts) - send.nbytes
        self.traffic.add("allgather", others, others)
        return DONE

    def broadcast(self, set_id: int, buf: Buffer, root: int) -> Done:
        comm = self._comms[set_id]
        wait_all([comm.Ibcast([buf, MPI.BYTE], root=root)])
        if comm.Get_size() > 1:
            is_root = comm.Get_rank() == root
            self.traffic.add("broadcast", buf.nbytes if is_root else 0,
                             0 if is_root else buf.nbytes)
        return DONE

    def alltoall(self, set_id: int, send: Buffer, send_counts: Sequence[int],
                 recv: Buffer, recv_counts: Sequence[int]) -> Done:
        comm = self._comms[set_id]
        wait_all([comm.Ialltoallv(
            [send, (list(send_counts), offsets(send_counts)), MPI.BYTE],
            [recv, (list(recv_counts), offsets(recv_counts)), MPI.BYTE])])
        me = comm.Get_rank()
        self.traffic.add("alltoall", sum(send_counts) - send_counts[me],
                         sum(recv_counts) - recv_counts[me])
        return DONE

    def reducescatter(self, set_id: int, buf: Buffer, counts: Sequence[int],
                      out: Buffer, op: ReduceOp) -> Done:
        comm = self._comms[set_id]
        if comm.Get_size() == 1:
            out[...] = buf[: counts[0]]
        else:
            wait_all([comm.Ireduce_scatter(buf, out, recvcounts=list(counts), op=MPI_OPS[op])])
            others = buf.nbytes - out.nbytes
            self.traffic.add("reducescatter", others, others)
        return DONE
