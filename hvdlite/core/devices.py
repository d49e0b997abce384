"""Devices and their array namespaces: the executor writes against the array API
that NumPy and CuPy share (``xp.concatenate(..., out=)``, ``xp.multiply``...),
and asks here which namespace serves a device.

The core never imports a GPU library: a GPU backend registers its namespace
(CuPy for "cuda") and its backend factory when it is loaded, and the CPU
path is NumPy.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

BackendFactory = Callable[[Any], Any]   # Config -> Backend

_NAMESPACES: dict[str, Any] = {"cpu": np}
_EXTRA_BACKENDS: list[BackendFactory] = []


def device_type(device: str) -> str:
    """"cuda:1" -> "cuda"; "cpu" -> "cpu"."""
    return device.split(":", 1)[0]


def array_namespace(device: str) -> Any:
    try:
        return _NAMESPACES[device_type(device)]
    except KeyError:
        raise LookupError(f"no array namespace is registered for device {device!r}; "
                          f"known: {sorted(_NAMESPACES)}") from None


def register_device(kind: str, namespace: Any) -> None:
    """Make ``namespace`` (a NumPy-compatible module) serve devices of ``kind``."""
    _NAMESPACES[kind] = namespace


def register_backend(factory: BackendFactory) -> None:
    """Put a backend ahead of the host backends in every engine's chain created
    from now on (``factory(config)`` builds it)."""
    if factory not in _EXTRA_BACKENDS:
        _EXTRA_BACKENDS.append(factory)


def extra_backends(config: Any) -> list[Any]:
    return [factory(config) for factory in _EXTRA_BACKENDS]
