"""The parameter-server allreduce: every worker sends its whole buffer to the
set's rank 0 (the server), which reduces them and sends the result back.

Never the default (``HVDLITE_ALLREDUCE=ps`` selects it): it is here to be
measured against the ring. Per allreduce of N bytes over P ranks the server
sends and receives N(P-1) bytes, each worker N each way; the ring moves
2N(P-1)/P per rank, so the server's link is the bottleneck from P = 3 on
(``python -m bench traffic`` shows both).

The server reduces the workers' buffers in rank order, receiving the next
one into a second scratch buffer while it reduces the current one, so the
result is the same on every run and rank. Half types arrive widened to
float32 (HostBackend.reduction_dtype); Average is a Sum here and the
executor divides, as for every host backend.
"""
from __future__ import annotations

import numpy as np
try:
    from mpi4py import MPI
except ImportError:     # no mpi4py (torchrun's transport): these backends decline every call
    MPI = None  # type: ignore[assignment]

from hvdlite.backends.base import DONE, UFUNCS, Done, HostBackend, ScratchPair
from hvdlite.reduce_op import ReduceOp
from hvdlite.transport.waits import wait_all

_TAG_PUSH, _TAG_PULL = 91, 92
SERVER = 0   # the server's rank within the process set (not global rank 0)


class ParameterServerBackend(HostBackend):
    """Allreduce (every elementwise op) of host buffers through the set's rank 0."""
    name = "ps"

    def __init__(self) -> None:
        super().__init__()
        self._scratch = ScratchPair()

    def supports(self, kind: str, dtype: np.dtype, device: str, nbytes: int,
                 op: ReduceOp = ReduceOp.SUM) -> bool:
        return (kind == "allreduce" and device == "cpu" and op is not ReduceOp.ADASUM
                and not self.declined)

    def allreduce(self, set_id: int, buf: np.ndarray, op: ReduceOp) -> Done:
        comm = self._comms[set_id]
        size = comm.Get_size()
        moved = 0
        if size > 1 and buf.size:
            if comm.Get_rank() == SERVER:
                self._serve(comm, buf, op)
                moved = buf.nbytes * (size - 1)
            else:
                wait_all([comm.Isend(buf, dest=SERVER, tag=_TAG_PUSH)])
                wait_all([comm.Irecv(buf, source=SERVER, tag=_TAG_PULL)])
                moved = buf.nbytes
        self.traffic.add("allreduce", moved, moved)
        return DONE

    def _serve(self, comm: MPI.Comm, buf: np.ndarray, op: ReduceOp) -> None:
        size, ufunc = comm.Get_size(), UFUNCS[op]
        scratch = self._scratch.pair(buf.dtype, buf.size)
        workers = [r for r in range(size) if r != SERVER]
        pending = comm.Irecv(scratch[0], source=workers[0], tag=_TAG_PUSH)
        for i in range(len(workers)):
            wait_all([pending])
            if i + 1 < len(workers):    # the next worker's buffer arrives during this reduction
                pending = comm.Irecv(scratch[(i + 1) % 2], source=workers[i + 1], tag=_TAG_PUSH)
            ufunc(buf, scratch[i % 2], out=buf)
        wait_all([comm.Isend(buf, dest=w, tag=_TAG_PULL) for w in workers])

