"""Fixtures shared by the unit tests."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Callable, Iterator

import pytest

from hvdlite.backends import registry
from hvdlite.engine import devices


@pytest.fixture
def device_registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Registries of devices and backends of the test's own, with the device type
    "fake" served by tests/unit/fake_device_plugin.py; the real one comes back after."""
    monkeypatch.setattr(devices, "_TYPES", dict(devices._TYPES))
    monkeypatch.setattr(registry, "_ENTRIES", list(registry._ENTRIES))
    monkeypatch.setattr(devices, "_PLUGINS", {"fake": "tests.unit.fake_device_plugin"})
    yield


@pytest.fixture
def load(monkeypatch: pytest.MonkeyPatch) -> Callable[..., SimpleNamespace]:
    """The GPU backends imported afresh over the CuPy and NCCL stand-ins (gpu_ranks.py)."""
    from tests.unit.gpu_ranks import loader     # only the GPU backend tests pay for it
    return loader(monkeypatch)


@pytest.fixture
def gpu(load: Callable[..., SimpleNamespace]) -> SimpleNamespace:
    return load()
