"""Devices and their array namespaces: the executor writes against the array API
that NumPy and CuPy share (``xp.concatenate(..., out=)``, ``xp.multiply``...),
and asks here which namespace serves a device.

The core never imports a GPU library. A device type other than "cpu" is
served by a plugin module among the backends (``hvdlite.backends.gpu`` for
"cuda"), loaded the first time a request names such a device; ``load`` reads
its array namespace (NAMESPACE), stream hooks (prepare, fence) and backend
classes (BACKENDS): the namespace and hooks are registered here, the backends in
``hvdlite.backends.registry`` (by their ``name``, for that device type).
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable, Optional, Sequence

import numpy as np

from hvdlite.backends import registry
from hvdlite.backends.registry import BackendFactory

# Modules that serve a device type when first needed (they call register_device).
_PLUGINS = {"cuda": "hvdlite.backends.gpu"}


@dataclasses.dataclass(frozen=True)
class DeviceType:
    """How the executor works on one kind of device.

    ``prepare(device, ready)`` runs on the engine thread before a request's
    buffers are touched: it makes the device current and orders the engine's
    stream after each ``ready`` event (recorded on the framework's stream when
    the request was submitted). ``fence(device)`` runs after a result is
    written and returns what the consumer's stream must wait on (None: nothing).
    """
    namespace: Any
    prepare: Callable[[str, Sequence[Any]], None] = lambda device, ready: None
    fence: Callable[[str], Any] = lambda device: None


_TYPES: dict[str, DeviceType] = {"cpu": DeviceType(np)}


@dataclasses.dataclass(frozen=True)
class Fenced:
    """A device result with the event its consumer must wait on before use."""
    value: Any
    fence: Any


def device_type(device: str) -> str:
    """"cuda:1" -> "cuda"; "cpu" -> "cpu"."""
    return device.split(":", 1)[0]


def load(kind: str) -> bool:
    """Load the plugin serving ``kind``; False if there is none."""
    if kind in _TYPES:
        return True
    name = _PLUGINS.get(kind)
    if name is None:
        return False
    plugin = importlib.import_module(name)     # it never imports the core back
    register_device(kind, DeviceType(plugin.NAMESPACE, plugin.prepare, plugin.fence))
    for factory in plugin.BACKENDS:
        registry.register_backend(factory.name, factory, kind)
    return True


def described(device: str) -> DeviceType:
    kind = device_type(device)
    if kind not in _TYPES and not load(kind):
        raise LookupError(f"no array namespace is registered for device {device!r}; "
                          f"known: {sorted(_TYPES)}")
    return _TYPES[kind]


def array_namespace(device: str) -> Any:
    return described(device).namespace


def register_device(kind: str, description: DeviceType) -> None:
    """Make ``description`` (a NumPy-compatible namespace and stream hooks) serve
    devices of ``kind``."""
    _TYPES[kind] = description


def register_backend(factory: BackendFactory, name: Optional[str] = None,
                     devices: registry.Devices = None, before: Optional[str] = None) -> None:
    """The earlier route, kept: ``hvdlite.backends.register_backend`` under the
    factory's ``name`` (else its ``__name__``), asked for every device type unless
    ``devices`` says which, ahead of the built-in backends."""
    chosen = name or getattr(factory, "name", None) or getattr(factory, "__name__", "")
    registry.register_backend(str(chosen).lower(), factory, devices, before=before)


def backend_factories() -> list[BackendFactory]:
    """The factories registered besides the built-in backends, in order of preference."""
    return [e.factory for e in registry.entries() if not e.builtin and e.factory is not None]


def ready_events(requests: Sequence[Optional[Any]]) -> list[Any]:
    return [r.ready for r in requests if r is not None and r.ready is not None]
