"""NCCL collectives on GPU buffers, on the engine's stream of each GPU.

One NCCL communicator (CuPy's) per process set of an MPI world, created at
the set's first GPU collective: set rank 0 makes the unique id and broadcasts
it over the set's MPI communicator. A set whose ranks share a GPU, which NCCL
refuses, is served by the staged backend instead (hvdlite/backends/gpu_sets.py,
shared with torch's NCCL backend). Half types reduce natively. Sets on the torch transport (torchrun) are
hvdlite/backends/torch_nccl.py's, over torch's own NCCL.

Average is always NCCL's Sum, divided afterwards by the executor: never NCCL's
own ncclAvg. NCCL 2.28's ncclAvg, out of place on a one-rank communicator,
leaves the tail of the output unwritten (stale memory at lengths that are not a
multiple of its vector width: 3 of 1,048,579 elements; 1 of 4,913), while Sum
in and out of place was right in every case measured. The division is the one
every other backend does (``hvdlite.engine.scaling.Scale``), so an Average means
the same thing on every path.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import ml_dtypes
import numpy as np

from hvdlite.backends.base import Buffer, offsets
from hvdlite.backends.cuda import StreamWork, current_stream
from hvdlite.backends.gpu_sets import PerSetNccl
from hvdlite.reduce_op import ReduceOp
from hvdlite.transport.base import Transport, TransportKind

try:
    from cupy.cuda import nccl
    NCCL_AVAILABLE = nccl.get_version() > 0
except Exception:          # CuPy without its NCCL binding: the staged path serves GPUs
    nccl, NCCL_AVAILABLE = None, False

if NCCL_AVAILABLE:
    _TYPES = {np.dtype(np.float16): nccl.NCCL_FLOAT16, np.dtype(np.float32): nccl.NCCL_FLOAT32,
              np.dtype(np.float64): nccl.NCCL_FLOAT64, np.dtype(np.int8): nccl.NCCL_INT8,
              np.dtype(np.uint8): nccl.NCCL_UINT8, np.dtype(np.int32): nccl.NCCL_INT32,
              np.dtype(np.uint32): nccl.NCCL_UINT32, np.dtype(np.int64): nccl.NCCL_INT64,
              np.dtype(np.uint64): nccl.NCCL_UINT64,
              np.dtype(ml_dtypes.bfloat16): nccl.NCCL_BFLOAT16}
    _OPS = {ReduceOp.SUM: nccl.NCCL_SUM, ReduceOp.AVERAGE: nccl.NCCL_SUM,
            ReduceOp.MIN: nccl.NCCL_MIN, ReduceOp.MAX: nccl.NCCL_MAX,
            ReduceOp.PRODUCT: nccl.NCCL_PROD}
else:
    _TYPES, _OPS = {}, {}

# Operations per NCCL group call: older NCCL releases refuse groups of more than 2048.
_GROUP_OPS = 1024


class NcclBackend(PerSetNccl):
    name = "nccl"

    def __init__(self, config: Any) -> None:
        self._declined = False          # True on a world of another kind than MPI
        super().__init__(config)

    def supports(self, kind: str, dtype: np.dtype, device: str, nbytes: int,
                 op: ReduceOp = ReduceOp.SUM) -> bool:
        return (self._enabled and not self._declined and device.startswith("cuda")
                and np.dtype(dtype) in _TYPES and op is not ReduceOp.ADASUM)

    def open_set(self, set_id: int, transport: Transport) -> None:
        if transport.kind is TransportKind.MPI:
            self._serve(set_id, transport)
        else:                           # torchrun's world: torch-nccl serves its sets
            self._declined = True
        self._staged.open_set(set_id, transport)

    def _make(self, transport: Transport) -> Any:
        """Set rank 0 draws the unique id and broadcasts it over the set's transport."""
        uid = nccl.get_unique_id() if transport.rank == 0 else None
        uid = transport.bcast(uid, root=0)
        return nccl.NcclCommunicator(transport.size, uid, transport.rank)

    def _release(self, communicator: Any) -> None:
        communicator.destroy()

    def allreduce(self, set_id: int, buf: Buffer, op: ReduceOp) -> Any:
        communicator = self._communicator(set_id)
        if communicator is None:
            return self._staged.allreduce(set_id, buf, op)
        stream = current_stream()
        communicator.allReduce(buf.data.ptr, buf.data.ptr, buf.size, _TYPES[buf.dtype],
                               _OPS[op], stream.ptr)
        self._count_allreduce(set_id, buf.nbytes)
        return StreamWork(stream)

    def allreduce_many(self, set_id: int, pairs: Sequence[tuple[Buffer, Buffer]],
                       op: ReduceOp) -> Optional[StreamWork]:
        """Reduce each (input, output) pair, in one NCCL group (one launch, no fusion
        buffer); None where this set is staged (ranks share a GPU): the executor
        then fuses as usual. Average is a Sum here, divided by the executor after
        (see the module's docstring for why never ncclAvg)."""
        communicator = self._communicator(set_id)
        if communicator is None:
            return None
        stream = current_stream()
        nccl_op = _OPS[op]
        for first in range(0, len(pairs), _GROUP_OPS):
            nccl.groupStart()
            try:
                for source, target in pairs[first:first + _GROUP_OPS]:
                    communicator.allReduce(source.data.ptr, target.data.ptr, target.size,
                                           _TYPES[target.dtype], nccl_op, stream.ptr)
            finally:
                nccl.groupEnd()
        self._count_allreduce(set_id, sum(target.nbytes for _, target in pairs))
        return StreamWork(stream)

    def broadcast(self, set_id: int, buf: Buffer, root: int) -> Any:
        communicator = self._communicator(set_id)
        if communicator is None:
            return self._staged.broadcast(set_id, buf, root)
        stream = current_stream()
        communicator.broadcast(buf.data.ptr, buf.data.ptr, buf.size, _TYPES[buf.dtype], root,
                               stream.ptr)
        self._count_broadcast(set_id, buf.nbytes, root)
        return StreamWork(stream)

    def allgather(self, set_id: int, send: Buffer, recv: Buffer,
                  counts: Sequence[int]) -> Any:
        """Counts may differ per rank: one broadcast per rank, grouped."""
        communicator = self._communicator(set_id)
        if communicator is None:
            return self._staged.allgather(set_id, send, recv, counts)
        stream, me = current_stream(), self._sets[set_id].rank
        kind = _TYPES[recv.dtype]
        nccl.groupStart()
        for root, (start, count) in enumerate(zip(offsets(counts), counts)):
            if count:
                source = send.data.ptr if root == me else recv.data.ptr + start
                communicator.broadcast(source, recv.data.ptr + start, count, kind, root,
                                       stream.ptr)
        nccl.groupEnd()
        others = sum(counts) - send.nbytes
        self.traffic.add("allgather", others, others)
        return StreamWork(stream)

    def alltoall(self, set_id: int, send: Buffer, send_counts: Sequence[int],
                 recv: Buffer, recv_counts: Sequence[int]) -> Any:
        communicator = self._communicator(set_id)
        if communicator is None:
            return self._staged.alltoall(set_id, send, send_counts, recv, recv_counts)
        stream = current_stream()
        kind = _TYPES[recv.dtype]
        nccl.groupStart()
        for peer, (s_off, s_n, r_off, r_n) in enumerate(zip(
                offsets(send_counts), send_counts, offsets(recv_counts), recv_counts)):
            if s_n:
                communicator.send(send.data.ptr + s_off, s_n, kind, peer, stream.ptr)
            if r_n:
                communicator.recv(recv.data.ptr + r_off, r_n, kind, peer, stream.ptr)
        nccl.groupEnd()
        me = self._sets[set_id].rank
        self.traffic.add("alltoall", sum(send_counts) - send_counts[me],
                         sum(recv_counts) - recv_counts[me])
        return StreamWork(stream)

    def reducescatter(self, set_id: int, buf: Buffer, counts: Sequence[int],
                      out: Buffer, op: ReduceOp) -> Any:
        """Counts may differ by a row: one reduce per rank, grouped."""
        communicator = self._communicator(set_id)
        if communicator is None:
            return self._staged.reducescatter(set_id, buf, counts, out, op)
        stream, me = current_stream(), self._sets[set_id].rank
        kind, itemsize = _TYPES[buf.dtype], buf.dtype.itemsize
        nccl.groupStart()
        for root, (start, count) in enumerate(zip(offsets(counts), counts)):
            if count:
                target = out.data.ptr if root == me else buf.data.ptr + start * itemsize
                communicator.reduce(buf.data.ptr + start * itemsize, target, count, kind,
                                    _OPS[op], root, stream.ptr)
        nccl.groupEnd()
        others = buf.nbytes - out.nbytes
        self.traffic.add("reducescatter", others, others)
        return StreamWork(stream)
