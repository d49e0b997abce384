"""A host backend defined outside the hvdlite package, as a user's would be, for
tests/mpi/test_registered_backend.py: allreduce (elementwise ops) by gathering every
rank's buffer over the set's MPI communicator (``transport.comm``: it serves sets on
an MPI transport only) and reducing the rows in rank order with NumPy, so its result is checkable against a NumPy reference. It counts its calls."""
from __future__ import annotations

from typing import Any

import numpy as np

from hvdlite.backends.base import DONE, UFUNCS, Done, widened_dtype
from hvdlite.reduce_op import ReduceOp
from hvdlite.transport.base import Transport, TransportKind


class ToyBackend:
    name = "toy"

    def __init__(self, config: Any) -> None:
        self._comms: dict[int, Any] = {}
        self.calls = 0          # allreduces this rank ran here: proof that it was used
        self.configured = config

    def configure(self, config: Any) -> None:
        self.configured = config

    def supports(self, kind: str, dtype: np.dtype, device: str, nbytes: int,
                 op: ReduceOp = ReduceOp.SUM) -> bool:
        return kind == "allreduce" and device == "cpu" and op in UFUNCS and bool(self._comms)

    def reduction_dtype(self, dtype: np.dtype) -> np.dtype:
        return widened_dtype(dtype)

    def open_set(self, set_id: int, transport: Transport) -> None:
        if transport.kind is TransportKind.MPI:
            self._comms[set_id] = transport.comm

    def close_set(self, set_id: int) -> None:
        self._comms.pop(set_id, None)

    def allreduce(self, set_id: int, buf: np.ndarray, op: ReduceOp) -> Done:
        comm = self._comms[set_id]
        rows = np.empty((comm.Get_size(), buf.size), dtype=buf.dtype)
        comm.Allgather(buf, rows)
        result = rows[0].copy()
        for row in rows[1:]:
            UFUNCS[op](result, row, out=result)
        buf[...] = result
        self.calls += 1
        return DONE
