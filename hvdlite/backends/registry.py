"""Backends by name, with the device types each serves (torch c10d's
``Backend.register_backend(name, func, devices=...)``).

``hvdlite.engine.chain`` builds each device type's chain from this table: the
backends HVDLITE_BACKENDS names for that device first, then every registered
backend serving it, in table order. A backend registered here goes ahead of the
built-in ones (after those registered before it) unless ``before=`` places it
elsewhere, so a registered host backend is asked before MPI, which accepts every
host call. HVDLITE_BACKENDS is checked against this table by ``init()``.

Importing this module starts nothing: the built-in factories import their
backend's module (and with it mpi4py or CuPy) only when a chain is built.
"""
from __future__ import annotations

import dataclasses
import importlib
import re
from typing import Any, Callable, Iterable, Optional, Sequence, Union

from hvdlite.errors import (BackendRegistryMismatchError, ConfigError, UnknownBackendError,
                            UsageError)

BackendFactory = Callable[[Any], Any]    # Config -> Backend
Devices = Union[str, Sequence[str], None]

_NAME = re.compile(r"[a-z][a-z0-9_.-]*\Z")   # no ':' or ',': HVDLITE_BACKENDS splits on them


@dataclasses.dataclass(frozen=True)
class Entry:
    """One registered backend. ``devices`` None: asked for every device type (its
    ``supports`` decides). ``plugin``: a built-in backend a device plugin brings when it
    loads, declared here first so HVDLITE_BACKENDS may name it; its ``factory`` is None
    until then."""
    name: str
    factory: Optional[BackendFactory]
    devices: Optional[frozenset[str]]
    builtin: bool = False
    plugin: bool = False

    def serves(self, device_type: str) -> bool:
        return self.devices is None or device_type in self.devices

    def served(self) -> str:
        return "every device" if self.devices is None else ", ".join(sorted(self.devices))


def _builtin(module: str, cls: str, *fields: str) -> BackendFactory:
    """A factory importing its backend when first called; ``fields`` of the Config
    are its constructor's arguments."""
    def make(config: Any) -> Any:
        backend_class = getattr(importlib.import_module(module), cls)
        return backend_class(*(getattr(config, field) for field in fields))
    make.__qualname__ = cls
    return make


# The host backends in order of preference (HVDLITE_ALLREDUCE selects among ps, ring
# and mpi; see hvdlite.engine.chain); the CUDA plugin (hvdlite.backends.gpu) brings
# torch-nccl, nccl and staged, with their factories, when a request first names a cuda
# device.
# "transport" serves host data on a world transport that is no MPI communicator
# (torchrun's Gloo; hvdlite.backends.on_transport): the chain asks it only there, and
# the MPI-based host backends only where the world is MPI (hvdlite.engine.chain).
_ENTRIES: list[Entry] = [
    Entry("transport", _builtin("hvdlite.backends.on_transport", "TransportBackend"),
          frozenset({"cpu"}), True),
    Entry("adasum", _builtin("hvdlite.backends.adasum", "AdasumBackend"), frozenset({"cpu"}), True),
    Entry("ps", _builtin("hvdlite.backends.ps", "ParameterServerBackend"), frozenset({"cpu"}), True),
    Entry("ring", _builtin("hvdlite.backends.ring", "RingBackend", "ring_chunk"),
          frozenset({"cpu"}), True),
    Entry("mpi", _builtin("hvdlite.backends.mpi", "MpiBackend"), frozenset({"cpu"}), True),
    Entry("torch-nccl", None, frozenset({"cuda"}), True, plugin=True),
    Entry("nccl", None, frozenset({"cuda"}), True, plugin=True),
    Entry("staged", None, frozenset({"cuda"}), True, plugin=True),
]


def register_backend(name: str, factory: BackendFactory, devices: Devices = "cpu", *,
                     before: Optional[str] = None) -> None:
    """Make ``factory(config)`` (a :class:`hvdlite.backends.Backend`) serve requests on
    ``devices`` (device types: "cpu", "cuda"; None for every type) under ``name``.

    It is asked ahead of every built-in backend and after the backends registered
    before it, or just ahead of the backend named ``before``. Registering the same
    name, factory and devices again does nothing; another backend under a taken
    name is refused (UsageError). Call it on every rank before ``hvdlite.init()``
    (a running hvdlite reads the registry again at its next ``reconfigure``)."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise UsageError(f"a backend name is lowercase letters, digits, '_', '.' and '-', "
                         f"starting with a letter; got {name!r}")
    if not callable(factory):
        raise UsageError(f"backend {name!r}: the factory {factory!r} is not callable")
    entry = Entry(name, factory, _device_set(devices))
    index = _index(name)
    if index is not None:
        _replace_declared(index, entry)
        return
    position = _position(before)
    _ENTRIES.insert(position, entry)


def unregister_backend(name: str) -> None:
    """Remove a backend registered with :func:`register_backend` (built-in ones stay);
    a running hvdlite drops it at its next ``reconfigure``."""
    index = _index(name)
    if index is None or _ENTRIES[index].builtin:
        raise UsageError(f"no registered backend {name!r} to remove "
                         f"(built-in ones cannot be); registered: {', '.join(names())}")
    del _ENTRIES[index]


def _device_set(devices: Devices) -> Optional[frozenset[str]]:
    if devices is None:
        return None
    kinds = frozenset([devices] if isinstance(devices, str) else devices)
    if not kinds or not all(isinstance(k, str) and k and ":" not in k for k in kinds):
        raise UsageError(f"devices are device types such as 'cpu' or 'cuda' (not 'cuda:0'); "
                         f"got {devices!r}")
    return kinds


def _replace_declared(index: int, entry: Entry) -> None:
    """The same registration again is a no-op; a plugin's built-in backend fills in
    its declared entry (again if the plugin is imported afresh); anything else under a
    taken name is refused."""
    taken = _ENTRIES[index]
    if taken.factory is entry.factory and taken.devices == entry.devices:
        return
    if taken.plugin and taken.devices == entry.devices:
        _ENTRIES[index] = dataclasses.replace(taken, factory=entry.factory)
        return
    raise UsageError(f"backend {taken.name!r} is already registered (for {taken.served()}); "
                     f"choose another name, or unregister_backend({taken.name!r}) first")


def _position(before: Optional[str]) -> int:
    if before is None:      # after the other registered ones, ahead of the built-in ones
        return next((i for i, e in enumerate(_ENTRIES) if e.builtin), len(_ENTRIES))
    index = _index(before)
    if index is None:
        raise UnknownBackendError(before, names(), "before=")
    return index


def _index(name: str) -> Optional[int]:
    return next((i for i, entry in enumerate(_ENTRIES) if entry.name == name), None)


def entries() -> tuple[Entry, ...]:
    """Every backend, in order of preference."""
    return tuple(_ENTRIES)


def names() -> list[str]:
    return sorted(entry.name for entry in _ENTRIES)


def preferences(setting: str) -> list[tuple[Optional[str], str]]:
    """HVDLITE_BACKENDS ("cpu:toy,cuda:nccl,other") as (device type or None, name)."""
    pairs: list[tuple[Optional[str], str]] = []
    for item in filter(None, (part.strip() for part in setting.split(","))):
        device, _, name = item.rpartition(":")
        pairs.append((device or None, name))
    return pairs


def preferred(setting: str, device_type: str) -> list[str]:
    """The names HVDLITE_BACKENDS puts first for ``device_type``, in its order."""
    found: list[str] = []
    for device, name in preferences(setting):
        entry = next((e for e in _ENTRIES if e.name == name), None)
        if (device == device_type or (device is None and entry is not None
                                      and entry.serves(device_type))) and name not in found:
            found.append(name)
    return found


def check(setting: str) -> None:
    """Refuse an HVDLITE_BACKENDS that names an unregistered backend
    (UnknownBackendError) or a device its backend does not serve (ConfigError)."""
    for device, name in preferences(setting):
        index = _index(name)
        if index is None:
            raise UnknownBackendError(name, names(), "HVDLITE_BACKENDS")
        entry = _ENTRIES[index]
        if device is not None and not entry.serves(device):
            raise ConfigError(f"HVDLITE_BACKENDS={setting!r} asks backend {name!r} for "
                              f"{device}, but it serves {entry.served()}")



# -- agreement across ranks (init) ------------------------------------------------------------
Described = tuple[tuple[str, Optional[tuple[str, ...]]], ...]   # (name, device types) in order


def described() -> Described:
    """The table as ranks compare it: names and device types in order of preference
    (not factories: a plugin's is filled in when it loads, at a request every rank runs)."""
    return tuple((e.name, None if e.devices is None else tuple(sorted(e.devices)))
                 for e in _ENTRIES)


def agree(transport: Any, mine: Optional[Described] = None) -> None:
    """Raise BackendRegistryMismatchError on every rank unless every rank's table is
    rank 0's: one allgather, made by ``init()`` once the transport is up, so a backend
    registered on some ranks only fails at init, not as ranks that silently differ."""
    tables = transport.allgather(described() if mine is None else mine)
    differing = [r for r, table in enumerate(tables) if table != tables[0]]
    if not differing:
        return
    lines, names_differing = [], set()
    for rank in differing:
        line, named = _difference(tables[0], tables[rank])
        lines.append(f"rank {rank} {line}")
        names_differing |= named
    raise BackendRegistryMismatchError(
        f"rank {transport.rank}: ranks registered different backends, so they would "
        f"pick different ones for the same collective: {'; '.join(lines)} (as against "
        f"rank 0's {', '.join(n for n, _ in tables[0])}). Register every backend on every "
        "rank, in the same order and for the same devices "
        "(hvdlite.backends.register_backend), before hvdlite.init().",
        differing, sorted(names_differing))


def _difference(reference: Described, other: Described) -> tuple[str, set[str]]:
    """What ``other`` has that ``reference`` (rank 0's) has not, and the reverse."""
    theirs, ours = dict(other), dict(reference)
    lacks = [n for n in ours if n not in theirs]
    extra = [n for n in theirs if n not in ours]
    devices = [n for n in ours if n in theirs and ours[n] != theirs[n]]
    parts = ([f"lacks {lacks}"] if lacks else []) + ([f"also has {extra}"] if extra else [])
    parts += [f"serves {theirs[n] or 'every device'} with {n!r}, not "
              f"{ours[n] or 'every device'}" for n in devices]
    if not parts:
        parts = [f"has them in another order ({', '.join(theirs)})"]
    return ", ".join(parts), set(lacks + extra + devices) or set(theirs)
