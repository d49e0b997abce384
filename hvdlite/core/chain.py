"""The chain of backends: the first that supports a request runs it.

GPU backends (registered by a device plugin in ``hvdlite.core.devices``)
come first, the host backends after them, and MPI ends every chain
(Horovod's operation manager; torch c10d's one ProcessGroup per backend).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from hvdlite.backends.adasum import AdasumBackend
from hvdlite.backends.mpi import MpiBackend
from hvdlite.backends.ps import ParameterServerBackend
from hvdlite.backends.ring import RingBackend
from hvdlite.core import devices
from hvdlite.reduce_op import ReduceOp

_PICK_MEMO_SIZE = 4096   # distinct (kind, dtype, device, size, op) calls remembered


class BackendChain:
    """Backends in order of preference, rebuilt by ``configure`` (HVDLITE_ALLREDUCE)."""

    def __init__(self, config: Any) -> None:
        self._mpi = MpiBackend()
        self._ring = RingBackend(config.ring_chunk)
        self._adasum = AdasumBackend()
        self._ps = ParameterServerBackend()
        self._factories: list[Any] = []
        self._extra: list[Any] = []
        self._comms: dict[int, Any] = {}       # open sets, for backends that arrive later
        self.backends: list[Any] = []
        self.configure(config)

    def configure(self, config: Any) -> None:
        self._config = config
        for backend in self._extra:
            if hasattr(backend, "configure"):
                backend.configure(config)
        self._ring.min_bytes = config.ring_threshold if config.allreduce == "auto" else 0
        self._ring.chunk_bytes = max(64, config.ring_chunk)   # a reconfigure changes it too
        # Adasum runs only on its own backend, whatever HVDLITE_ALLREDUCE says.
        host = {"mpi": [self._mpi], "ps": [self._ps, self._mpi]}.get(
            config.allreduce, [self._ring, self._mpi])
        host = [self._adasum] + host
        self.backends = self._extra + host
        self._picked: dict[tuple, Any] = {}
        self._picks: dict[tuple, Any] = {}

    def every_backend(self) -> list[Any]:
        return self._extra + [self._adasum, self._ps, self._ring, self._mpi]

    def _counting(self) -> list[Any]:
        return [b for b in self.every_backend() if hasattr(b, "traffic")]

    def traffic(self) -> dict[str, Any]:
        """Bytes each backend moved for this rank (see backends.base.Traffic; the GPU
        backends, nccl and staged, count estimates);
        safe to call from any thread."""
        return {b.name: {"exact": b.traffic.exact, "kinds": b.traffic.snapshot()}
                for b in self._counting()}

    def traffic_totals(self) -> tuple[int, int, int]:
        """(bytes sent, bytes received, of which estimated) over every backend:
        cheap enough to read at every optimizer step."""
        sent = received = estimated = 0
        for backend in self._counting():
            backend_sent, backend_received = backend.traffic.totals
            sent, received = sent + backend_sent, received + backend_received
            if not backend.traffic.exact:
                estimated += backend_sent + backend_received
        return sent, received, estimated

    def open_set(self, set_id: int, comm: Any) -> None:
        self._comms[set_id] = comm
        for backend in self.every_backend():
            backend.open_set(set_id, comm)

    def close_set(self, set_id: int) -> None:
        self._comms.pop(set_id, None)
        for backend in self.every_backend():
            backend.close_set(set_id)

    def _refresh(self) -> None:
        """Backends registered since (a device plugin loaded at its first request)
        join the front of the chain and serve every open set."""
        for factory in devices.backend_factories():
            if factory not in self._factories:
                self._factories.append(factory)
                backend = factory(self._config)
                self._extra.append(backend)
                for set_id, comm in self._comms.items():
                    backend.open_set(set_id, comm)
        self.configure(self._config)

    def pick(self, kind: str, dtype: np.dtype, device: str, nbytes: int,
             op: ReduceOp = ReduceOp.SUM) -> Any:
        """The first backend in the chain that supports this call. Remembered per
        call shape until the chain is reconfigured: steady-state training asks the
        same few questions every step, and each answer walks the chain."""
        key = (kind, dtype, device, nbytes, op)
        backend = self._picks.get(key)
        if backend is None:
            backend = self._first_supporting(kind, dtype, device, nbytes, op)
            if len(self._picks) >= _PICK_MEMO_SIZE:
                self._picks.clear()
            self._picks[key] = backend
        return backend

    def _first_supporting(self, kind: str, dtype: np.dtype, device: str, nbytes: int,
                          op: ReduceOp) -> Any:
        for attempt in range(2):
            for backend in self.backends:
                if backend.supports(kind, dtype, device, nbytes, op):
                    return backend
            if attempt == 0 and devices.load(devices.device_type(device)):
                self._refresh()
        raise LookupError(f"no backend supports {kind} ({op.name}) of {dtype} on {device}; the chain "
                          f"is {[b.name for b in self.backends]}")

    def reduction_dtype(self, dtype: np.dtype, device: str) -> np.dtype:
        key = (dtype, device)
        wide = self._picked.get(key)
        if wide is None:
            wide = self._picked[key] = self.pick("allreduce", dtype, device, 0).reduction_dtype(dtype)
        return wide
