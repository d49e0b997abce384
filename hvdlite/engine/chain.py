"""The chain of backends: the first that supports a request runs it.

Each device type has its own chain, built from the backend registry
(``hvdlite.backends.registry``, by name and device type, as torch c10d's):
the backends HVDLITE_BACKENDS names for that device first, then every backend
registered for it in the registry's order (registered ones ahead of the
built-in ones). Among the built-in host backends HVDLITE_ALLREDUCE chooses;
MPI accepts every host call, so it ends the host chain (Horovod's operation
manager; torch c10d's one ProcessGroup per backend).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from hvdlite.backends import registry
from hvdlite.engine import devices
from hvdlite.reduce_op import ReduceOp
from hvdlite.transport.base import Transport, TransportKind

_PICK_MEMO_SIZE = 4096   # distinct (kind, dtype, device, size, op) calls remembered

# The built-in host backends each HVDLITE_ALLREDUCE value asks (adasum: only op=Adasum).
_HOST = {"mpi": {"adasum", "mpi"}, "ps": {"adasum", "ps", "mpi"}}
_HOST_DEFAULT = {"adasum", "ring", "mpi"}
_HOST_BUILTIN = {"adasum", "ps", "ring", "mpi"}
# The built-in host backend of a world transport other than MPI (torchrun's Gloo).
_ON_TRANSPORT = "transport"


class BackendChain:
    """Backends per device type, in order of preference; rebuilt by ``configure``.

    The registry is read only there: at init, at a negotiated reconfiguration and when
    a device plugin loads at a request's first run, points every rank passes in the
    same order, so no rank picks a backend its peers do not (a backend registered
    after init() joins at the next ``reconfigure``)."""

    def __init__(self, config: Any) -> None:
        self._made: dict[str, Any] = {}        # name -> backend, each made once
        self._transports: dict[int, Transport] = {}   # open sets, for backends that arrive later
        self._also_counted: list[Any] = []
        self.configure(config)

    def configure(self, config: Any) -> None:
        """Apply settings. An unregistered name in HVDLITE_BACKENDS raises
        UnknownBackendError here: at init(), on every rank, before any collective."""
        registry.check(config.backends)
        self._config = config
        self._make_new()
        for name, backend in list(self._made.items()):
            self._apply(name, backend)
        self._chains: dict[str, list[Any]] = {}
        self._picked: dict[tuple, Any] = {}
        self._picks: dict[tuple, Any] = {}

    def _apply(self, name: str, backend: Any) -> None:
        if hasattr(backend, "configure"):
            backend.configure(self._config)
        if name == "ring":
            config = self._config
            backend.min_bytes = config.ring_threshold if config.allreduce == "auto" else 0
            backend.chunk_bytes = max(64, config.ring_chunk)   # a reconfigure changes it too

    def _make_new(self) -> None:
        """Backends registered since the last build, made and serving every open set
        (``_make``); those unregistered since, closed and dropped. The MPI-based host
        backends wait for the first set, and are made only if it is on an MPI
        transport: on torchrun's world they are never asked, and making them imports
        mpi4py's MPI, which starts an MPI in every worker."""
        self._entries = {entry.name: entry for entry in registry.entries() if entry.factory}
        for name in [n for n in self._made if n not in self._entries]:
            backend = self._made.pop(name)
            for set_id in self._transports:
                backend.close_set(set_id)
        self._make_wanted()

    def _make_wanted(self) -> None:
        mpi_world = bool(self._transports) and not self._on_transport()
        for name, entry in self._entries.items():
            if name not in self._made and (mpi_world or not self._mpi_based(entry)):
                self._make(name)

    @staticmethod
    def _mpi_based(entry: Any) -> bool:
        return entry.builtin and entry.name in _HOST_BUILTIN

    def _on_transport(self) -> bool:
        """Whether the world is another transport's (torchrun's Gloo), not MPI's."""
        return any(t.kind is not TransportKind.MPI for t in self._transports.values())

    def _make(self, name: str) -> Any:
        """The backend ``name``, made, configured and serving every open set if new."""
        backend = self._made.get(name)
        if backend is None:
            backend = self._entries[name].factory(self._config)
            self._apply(name, backend)
            for set_id, transport in self._transports.items():
                backend.open_set(set_id, transport)
            self._made[name] = backend
        return backend

    def chain_for(self, device_type: str) -> list[Any]:
        """The backends asked for ``device_type``, in order."""
        chain = self._chains.get(device_type)
        if chain is None:
            names = registry.preferred(self._config.backends, device_type)
            names += [e.name for e in registry.entries() if e.serves(device_type)
                      and e.name not in names and self._asked(e)]
            chain = self._chains[device_type] = [self._make(n) for n in names if n in self._entries]
        return chain

    def _asked(self, entry: Any) -> bool:
        """Whether the chain asks a backend it was not told to (HVDLITE_BACKENDS): the
        built-in host backends HVDLITE_ALLREDUCE selects on an MPI world, and on
        another transport's world its own backend alone (the MPI ones step aside)."""
        if not entry.builtin:
            return True
        on_transport = self._on_transport()
        if entry.name == _ON_TRANSPORT:
            return on_transport
        if entry.name in _HOST_BUILTIN:
            host = _HOST.get(self._config.allreduce, _HOST_DEFAULT)
            return entry.name in host and not on_transport
        return True

    @property
    def backends(self) -> list[Any]:
        return self.every_backend()

    def backend(self, name: str) -> Any:
        """The backend ``name``, made if no chain has asked it yet."""
        return self._make(name)

    def every_backend(self) -> list[Any]:
        """Every backend made so far, in the registry's order."""
        return [self._made[e.name] for e in registry.entries() if e.name in self._made]

    def _counting(self) -> list[Any]:
        return [b for b in self.every_backend() if hasattr(b, "traffic")] + self._also_counted

    def also_counting(self, counted: Any) -> None:
        """Count ``counted.traffic`` under ``counted.name`` with the backends' (the lanes)."""
        self._also_counted.append(counted)

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

    def open_set(self, set_id: int, transport: Transport) -> None:
        self._transports[set_id] = transport
        self._chains.clear()       # which backends are asked depends on the sets' kind
        self._picks.clear()
        self._picked.clear()
        for backend in self.every_backend():
            backend.open_set(set_id, transport)
        self._make_wanted()        # the first set tells whether the world is MPI's

    def close_set(self, set_id: int) -> None:
        self._transports.pop(set_id, None)
        for backend in self.every_backend():
            backend.close_set(set_id)

    def pick(self, kind: str, dtype: np.dtype, device: str, nbytes: int,
             op: ReduceOp = ReduceOp.SUM) -> Any:
        """The first backend in the device's chain that supports this call. Remembered
        per call shape until the chain is reconfigured: steady-state training asks the
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
        device_type = devices.device_type(device)
        for attempt in range(2):
            for backend in self.chain_for(device_type):
                if backend.supports(kind, dtype, device, nbytes, op):
                    return backend
            # A device plugin registers its backends when it loads (first request).
            if attempt == 0 and devices.load(device_type):
                self.configure(self._config)
        raise LookupError(f"no backend supports {kind} ({op.name}) of {dtype} on {device}; the chain "
                          f"is {[b.name for b in self.chain_for(device_type)]}")

    def reduction_dtype(self, dtype: np.dtype, device: str) -> np.dtype:
        key = (dtype, device)
        wide = self._picked.get(key)
        if wide is None:
            wide = self._picked[key] = self.pick("allreduce", dtype, device, 0).reduction_dtype(dtype)
        return wide
