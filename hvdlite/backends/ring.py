"""hvdlite's ring allreduce over MPI point-to-point.

Reduce-scatter then allgather, 2(P-1) steps, each rank sending 2(P-1)/P of
the buffer in total: bandwidth-optimal. Messages are cut into chunks of
HVDLITE_RING_CHUNK bytes and received into two persistent scratch chunks, so
the reduction of one chunk overlaps the transfer of the next and no step
allocates (and page-faults) a fresh temporary. Every wait is ``waits.wait_all``'s (a
peer that stops answering is found there).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
try:
    from mpi4py import MPI
except ImportError:     # no mpi4py (torchrun's transport): these backends decline every call
    MPI = None  # type: ignore[assignment]

from hvdlite.backends.base import (DONE, UFUNCS, Done, HostBackend, ScratchPair, even_counts,
                                   segment_bounds)
from hvdlite.reduce_op import ReduceOp
from hvdlite.transport.waits import wait_all

_TAG_REDUCE, _TAG_GATHER = 71, 72


def chunk_bounds(start: int, end: int, chunk: int) -> list[tuple[int, int]]:
    """Split [start, end) into pieces of at most ``chunk`` elements (none if empty)."""
    chunk = max(1, chunk)
    return [(s, min(s + chunk, end)) for s in range(start, end, chunk)]


def reduce_scatter_schedule(rank: int, size: int) -> list[tuple[int, int]]:
    """(segment sent, segment received and reduced) per step; rank r ends owning segment r."""
    return [((rank - s - 1) % size, (rank - s - 2) % size) for s in range(size - 1)]


def allgather_schedule(rank: int, size: int) -> list[tuple[int, int]]:
    """(segment sent, segment received) per step, starting from owning segment ``rank``."""
    return [((rank - s) % size, (rank - s - 1) % size) for s in range(size - 1)]


_RING_KINDS = frozenset({"allreduce", "reducescatter"})


class RingBackend(HostBackend):
    """Allreduce and reducescatter on host buffers of at least ``min_bytes``
    (HVDLITE_RING_THRESHOLD under HVDLITE_ALLREDUCE=auto, 0 when chosen outright)."""
    name = "ring"

    def __init__(self, chunk_bytes: int, min_bytes: int = 0) -> None:
        super().__init__()
        self.chunk_bytes = max(64, chunk_bytes)
        self.min_bytes = min_bytes
        self._scratch = ScratchPair()

    def supports(self, kind: str, dtype: np.dtype, device: str, nbytes: int,
                 op: ReduceOp = ReduceOp.SUM) -> bool:
        return (kind in _RING_KINDS and device == "cpu" and nbytes >= self.min_bytes
                and op is not ReduceOp.ADASUM and not self.declined)

    def allreduce(self, set_id: int, buf: np.ndarray, op: ReduceOp) -> Done:
        return self.allreduce_from(set_id, buf, buf, op)

    def allreduce_from(self, set_id: int, source: np.ndarray, buf: np.ndarray,
                       op: ReduceOp) -> Done:
        """Out of place for free: every segment of ``buf`` is first written by a
        reduction (reading ``source``) or by the allgather, never read before."""
        comm = self._comms[set_id]
        size = comm.Get_size()
        sent = received = 0
        if size > 1 and buf.size:
            bounds = segment_bounds(even_counts(buf.size, size))
            sent, received = self._reduce_scatter(comm, buf, bounds, op, source)
            more_sent, more_received = self._allgather(comm, buf, bounds)
            sent, received = sent + more_sent, received + more_received
        elif source is not buf:
            buf[...] = source
        self.traffic.add("allreduce", sent * buf.itemsize, received * buf.itemsize)
        return DONE

    def reducescatter(self, set_id: int, buf: np.ndarray, counts: Sequence[int],
                      out: np.ndarray, op: ReduceOp) -> Done:
        comm = self._comms[set_id]
        bounds = segment_bounds(counts)
        sent = received = 0
        if comm.Get_size() > 1:
            sent, received = self._reduce_scatter(comm, buf, bounds, op, buf)
        self.traffic.add("reducescatter", sent * buf.itemsize, received * buf.itemsize)
        start, end = bounds[comm.Get_rank()]
        out[...] = buf[start:end]
        return DONE

    def _reduce_scatter(self, comm: MPI.Comm, buf: np.ndarray,
                        bounds: Sequence[tuple[int, int]], op: ReduceOp,
                        source: np.ndarray) -> tuple[int, int]:
        """Rank r ends with segment r of the reduction in ``buf``. Each step reduces
        the received piece with this rank's own contribution from ``source`` into
        ``buf``, and the next step sends what the previous one reduced, so only the
        first send reads ``source``. Returns the elements sent and received (every
        segment but one each way)."""
        rank, size = comm.Get_rank(), comm.Get_size()
        right, left = (rank + 1) % size, (rank - 1) % size
        chunk = max(1, self.chunk_bytes // buf.itemsize)
        scratch = self._scratch.pair(buf.dtype, chunk)
        ufunc = UFUNCS[op]
        sent = received = 0
        for step, (send_seg, recv_seg) in enumerate(reduce_scatter_schedule(rank, size)):
            sent += bounds[send_seg][1] - bounds[send_seg][0]
            received += bounds[recv_seg][1] - bounds[recv_seg][0]
            outgoing = source if step == 0 else buf
            sends = [comm.Isend(outgoing[s:e], dest=right, tag=_TAG_REDUCE)
                     for s, e in chunk_bounds(*bounds[send_seg], chunk)]
            pieces = chunk_bounds(*bounds[recv_seg], chunk)
            pending = self._post_recv(comm, scratch[0], pieces, 0, left) if pieces else None
            for i, (s, e) in enumerate(pieces):
                wait_all([pending])
                if i + 1 < len(pieces):
                    pending = self._post_recv(comm, scratch[(i + 1) % 2], pieces, i + 1, left)
                ufunc(source[s:e], scratch[i % 2][: e - s], out=buf[s:e])
            wait_all(sends)
        return sent, received

    @staticmethod
    def _post_recv(comm: MPI.Comm, into: np.ndarray, pieces: Sequence[tuple[int, int]],
                   index: int, source: int) -> MPI.Request:
        s, e = pieces[index]
        return comm.Irecv(into[: e - s], source=source, tag=_TAG_REDUCE)

    def _allgather(self, comm: MPI.Comm, buf: np.ndarray,
                   bounds: Sequence[tuple[int, int]]) -> tuple[int, int]:
        """Returns the elements sent and received."""
        rank, size = comm.Get_rank(), comm.Get_size()
        right, left = (rank + 1) % size, (rank - 1) % size
        chunk = max(1, self.chunk_bytes // buf.itemsize)
        sent = received = 0
        for send_seg, recv_seg in allgather_schedule(rank, size):
            sent += bounds[send_seg][1] - bounds[send_seg][0]
            received += bounds[recv_seg][1] - bounds[recv_seg][0]
            requests = [comm.Irecv(buf[s:e], source=left, tag=_TAG_GATHER)
                        for s, e in chunk_bounds(*bounds[recv_seg], chunk)]
            requests += [comm.Isend(buf[s:e], dest=right, tag=_TAG_GATHER)
                         for s, e in chunk_bounds(*bounds[send_seg], chunk)]
            wait_all(requests)
        return sent, received
