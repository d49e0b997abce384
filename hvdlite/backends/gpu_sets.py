"""What the two NCCL backends share (``NcclBackend``, CuPy's NCCL on MPI's sets, and
``TorchNcclBackend``, torch's on torchrun's): one NCCL communicator per process set,
made at the set's first GPU collective, where every member runs the same collective
at the same point; none where two members share a GPU, which NCCL refuses, so the
staged backend serves that set. Every member decides alike, from one allgather of
(host, GPU) over the set's transport. Traffic is counted as estimates, with
the staged fallback's (NCCL picks its own algorithm).
"""
from __future__ import annotations

import socket
from typing import Any, Optional

import cupy
import numpy as np

from hvdlite.backends.staged import StagedBackend
from hvdlite.transport.base import Transport


class PerSetNccl:
    """Subclasses say which sets are theirs (``open_set`` calls ``_serve``) and how a
    set's communicator is made (``_make``) and released (``_release``)."""

    def __init__(self, config: Any) -> None:
        self._sets: dict[int, Transport] = {}           # the sets this backend serves
        self._comms: dict[int, Optional[Any]] = {}      # None: the set shares a GPU -> staged
        self._staged = StagedBackend(config)
        self.traffic = self._staged.traffic
        self.configure(config)

    def configure(self, config: Any) -> None:
        self._enabled = config.gpu_allreduce == "nccl"
        self._staged.configure(config)

    def reduction_dtype(self, dtype: np.dtype) -> np.dtype:
        return np.dtype(dtype)          # half types reduce natively

    def _serve(self, set_id: int, transport: Transport) -> None:
        self._sets[set_id] = transport

    def close_set(self, set_id: int) -> None:
        self._sets.pop(set_id, None)
        communicator = self._comms.pop(set_id, None)
        if communicator is not None:
            self._release(communicator)
        self._staged.close_set(set_id)

    def _communicator(self, set_id: int) -> Optional[Any]:
        """The set's NCCL communicator, made on first use; None: staged."""
        if set_id not in self._comms:
            transport = self._sets[set_id]
            placement = transport.allgather((socket.gethostname(), cupy.cuda.Device().id))
            shared = len(set(placement)) < len(placement)
            self._comms[set_id] = None if shared else self._make(transport)
        return self._comms[set_id]

    def _make(self, transport: Transport) -> Any:
        raise NotImplementedError

    def _release(self, communicator: Any) -> None:
        raise NotImplementedError

    def _count_allreduce(self, set_id: int, nbytes: int) -> None:
        size = self._sets[set_id].size
        estimate = 2 * nbytes * (size - 1) // size      # what a ring moves each way
        self.traffic.add("allreduce", estimate, estimate)

    def _count_broadcast(self, set_id: int, nbytes: int, root: int) -> None:
        transport = self._sets[set_id]
        if transport.size > 1:
            mine = transport.rank == root
            self.traffic.add("broadcast", nbytes if mine else 0, 0 if mine else nbytes)
