"""The host backend of a transport of a kind other than MPI (torchrun's: Gloo): it runs
each call on the transport's own data collectives (``allreduce_array``,
``broadcast_array``, ``allgather_array``; hvdlite/transport/base.py).

The engine opens each process set on every backend with the set's transport; the
MPI-based backends decline one of another kind (``HostBackend.declined``), and this
one leaves those of kind MPI to them. It is the registry's built-in "transport"
backend (HVDLITE_BACKENDS may name it): the chain asks it, and not the MPI ones,
once a set is opened on such a transport (hvdlite/engine/chain.py). An alltoall is
the transport's ``alltoall_array`` on bytes; a reducescatter is an allreduce of
which each rank keeps its slice (correct, and twice the traffic of a real one).
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from hvdlite.backends.base import DONE, Done, Traffic, widened_dtype
from hvdlite.reduce_op import ReduceOp
from hvdlite.transport.base import Transport, TransportKind

_KINDS = frozenset({"allreduce", "allgather", "broadcast", "reducescatter", "alltoall"})
_ELEMENTWISE = frozenset({ReduceOp.SUM, ReduceOp.AVERAGE, ReduceOp.MIN, ReduceOp.MAX,
                          ReduceOp.PRODUCT})


class TransportBackend:
    name = "transport"

    def __init__(self, config: Any = None) -> None:
        self._transports: dict[int, Transport] = {}
        # Estimates: the transport's library picks its own algorithm; counted as a
        # bandwidth-optimal one would move, as the mpi backend counts.
        self.traffic = Traffic(exact=False)

    def supports(self, kind: str, dtype: np.dtype, device: str, nbytes: int,
                 op: ReduceOp = ReduceOp.SUM) -> bool:
        return (kind in _KINDS and device == "cpu" and op in _ELEMENTWISE
                and bool(self._transports))

    def reduction_dtype(self, dtype: np.dtype) -> np.dtype:
        return widened_dtype(dtype)

    def open_set(self, set_id: int, transport: Transport) -> None:
        if transport.kind is not TransportKind.MPI:   # MPI's data is the MPI backends'
            self._transports[set_id] = transport

    def close_set(self, set_id: int) -> None:
        self._transports.pop(set_id, None)

    def allreduce(self, set_id: int, buf: np.ndarray, op: ReduceOp) -> Done:
        transport = self._transports[set_id]
        # Average is a Sum here: the executor divides afterwards (backends/base.py).
        if transport.size > 1 and buf.size:
            transport.allreduce_array(buf, ReduceOp.SUM if op is ReduceOp.AVERAGE else op)
        estimate = 2 * buf.nbytes * (transport.size - 1) // transport.size
        self.traffic.add("allreduce", estimate, estimate)
        return DONE

    def allgather(self, set_id: int, send: np.ndarray, recv: np.ndarray,
                  counts: Sequence[int]) -> Done:
        self._transports[set_id].allgather_array(send, recv, counts)
        others = (sum(counts) - send.size) * send.itemsize
        self.traffic.add("allgather", others, others)
        return DONE

    def broadcast(self, set_id: int, buf: np.ndarray, root: int) -> Done:
        transport = self._transports[set_id]
        transport.broadcast_array(buf, root)
        if transport.size > 1:
            mine = transport.rank == root
            self.traffic.add("broadcast", buf.nbytes if mine else 0, 0 if mine else buf.nbytes)
        return DONE

    def alltoall(self, set_id: int, send: np.ndarray, send_counts: Sequence[int],
                 recv: np.ndarray, recv_counts: Sequence[int]) -> Done:
        # The executor hands byte views and byte counts: the transport moves bytes.
        self._transports[set_id].alltoall_array(send, send_counts, recv, recv_counts)
        me = self._transports[set_id].rank
        self.traffic.add("alltoall", sum(send_counts) - send_counts[me],
                         sum(recv_counts) - recv_counts[me])
        return DONE

    def reducescatter(self, set_id: int, buf: np.ndarray, counts: Sequence[int],
                      out: np.ndarray, op: ReduceOp) -> Done:
        transport = self._transports[set_id]
        self.allreduce(set_id, buf, op)
        start = sum(counts[: transport.rank])
        out[...] = buf[start: start + counts[transport.rank]]
        return DONE
