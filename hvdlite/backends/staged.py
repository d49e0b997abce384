"""GPU buffers through the host: copy to pinned memory, run the host backend
(MPI, or the ring for large reductions; on the torch transport, its Gloo
collectives), copy back.

Correctness never depends on NCCL: this serves GPUs without NCCL, settings
that ask for it (HVDLITE_GPU_ALLREDUCE=mpi), and process sets whose ranks
share a GPU (NCCL refuses duplicate devices in a communicator). The copies
run on the engine's stream; the host collective waits for them, so a staged
op is finished when it returns.
"""
from __future__ import annotations

from typing import Any, Sequence

import cupy
import numpy as np

from hvdlite.backends.base import DONE, Buffer, Done, Traffic, widened_dtype
from hvdlite.backends.cuda import current_stream
from hvdlite.backends.mpi import MpiBackend
from hvdlite.backends.on_transport import TransportBackend
from hvdlite.backends.ring import RingBackend
from hvdlite.reduce_op import ReduceOp
from hvdlite.transport.base import Transport, TransportKind


class _Pinned:
    """One growing page-locked host buffer (fast device copies, no page faults)."""

    def __init__(self) -> None:
        self._memory: Any = None
        self._nbytes = 0

    def view(self, dtype: np.dtype, count: int, offset_bytes: int = 0) -> np.ndarray:
        if count == 0:       # nothing to stage (a rank with no rows): no memory may exist yet
            return np.empty(0, dtype)
        need = offset_bytes + count * np.dtype(dtype).itemsize
        if need > self._nbytes:
            self._nbytes = max(need, 2 * self._nbytes)
            self._memory = cupy.cuda.alloc_pinned_memory(self._nbytes)
        raw = np.frombuffer(self._memory, np.uint8, self._nbytes)
        return raw[offset_bytes:need].view(dtype)


class StagedBackend:
    name = "staged"

    def __init__(self, config: Any) -> None:
        self._mpi = MpiBackend()
        self._ring = RingBackend(config.ring_chunk)
        self._transport = TransportBackend()     # sets on a transport of another kind
        self._on_transport: set[int] = set()
        # The host backends count into one estimated total (MPI's part is an estimate).
        self.traffic = self._mpi.traffic = self._ring.traffic = self._transport.traffic = \
            Traffic(exact=False)
        self._pinned = _Pinned()
        self.configure(config)

    def configure(self, config: Any) -> None:
        self._ring_from = {"mpi": None, "ring": 0}.get(config.allreduce, config.ring_threshold)

    def supports(self, kind: str, dtype: np.dtype, device: str, nbytes: int,
                 op: ReduceOp = ReduceOp.SUM) -> bool:
        return device.startswith("cuda") and op is not ReduceOp.ADASUM

    def reduction_dtype(self, dtype: np.dtype) -> np.dtype:
        return widened_dtype(dtype)

    def open_set(self, set_id: int, transport: Transport) -> None:
        if transport.kind is TransportKind.MPI:
            self._mpi.open_set(set_id, transport)
            self._ring.open_set(set_id, transport)
        else:                                   # torchrun's: its own collectives
            self._on_transport.add(set_id)
            self._transport.open_set(set_id, transport)

    def close_set(self, set_id: int) -> None:
        self._on_transport.discard(set_id)
        self._transport.close_set(set_id)
        self._mpi.close_set(set_id)
        self._ring.close_set(set_id)

    def _host(self, set_id: int) -> Any:
        """The host backend of the set's gathers, broadcasts and alltoalls."""
        return self._transport if set_id in self._on_transport else self._mpi

    def _reducer(self, set_id: int, nbytes: int) -> Any:
        if set_id in self._on_transport:
            return self._transport
        use_ring = self._ring_from is not None and nbytes >= self._ring_from
        return self._ring if use_ring else self._mpi

    def _to_host(self, buf: Buffer, offset_bytes: int = 0) -> np.ndarray:
        host = self._pinned.view(buf.dtype, buf.size, offset_bytes)
        stream = current_stream()
        buf.get(stream=stream, out=host)
        stream.synchronize()          # the host collective reads it next
        return host

    @staticmethod
    def _to_device(host: np.ndarray, buf: Buffer) -> None:
        buf.set(host, stream=current_stream())

    def allreduce(self, set_id: int, buf: Buffer, op: ReduceOp) -> Done:
        host = self._to_host(buf)
        wide = _widened(host)
        self._reducer(set_id, wide.nbytes).allreduce(set_id, wide, op)
        if wide is not host:
            host[...] = wide
        self._to_device(host, buf)
        return DONE

    def allgather(self, set_id: int, send: Buffer, recv: Buffer,
                  counts: Sequence[int]) -> Done:
        host_send = self._to_host(send)
        host_recv = self._pinned.view(recv.dtype, recv.size, _aligned(host_send.nbytes))
        self._host(set_id).allgather(set_id, host_send, host_recv, counts)
        self._to_device(host_recv, recv)
        return DONE

    def broadcast(self, set_id: int, buf: Buffer, root: int) -> Done:
        host = self._to_host(buf)
        self._host(set_id).broadcast(set_id, host, root)
        self._to_device(host, buf)
        return DONE

    def alltoall(self, set_id: int, send: Buffer, send_counts: Sequence[int],
                 recv: Buffer, recv_counts: Sequence[int]) -> Done:
        host_send = self._to_host(send)
        host_recv = self._pinned.view(recv.dtype, recv.size, _aligned(host_send.nbytes))
        self._host(set_id).alltoall(set_id, host_send, send_counts, host_recv, recv_counts)
        self._to_device(host_recv, recv)
        return DONE

    def reducescatter(self, set_id: int, buf: Buffer, counts: Sequence[int],
                      out: Buffer, op: ReduceOp) -> Done:
        host = _widened(self._to_host(buf))
        host_out = np.empty(out.size, dtype=host.dtype)
        self._reducer(set_id, host.nbytes).reducescatter(set_id, host, counts, host_out, op)
        self._to_device(host_out.astype(out.dtype, copy=False), out)
        return DONE


def _widened(host: np.ndarray) -> np.ndarray:
    """Half types reach this backend unwidened when NCCL chose the dtype and then
    fell back here (ranks sharing a GPU); MPI cannot sum them, so widen on the host."""
    wide = widened_dtype(host.dtype)
    return host if wide == host.dtype else host.astype(wide)


def _aligned(nbytes: int) -> int:
    """Second region of the pinned buffer starts on a 64-byte boundary."""
    return (nbytes + 63) // 64 * 64
