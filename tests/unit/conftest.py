"""Fixtures shared by the unit tests."""
from __future__ import annotations

from typing import Iterator

import pytest

from hvdlite.core import devices


@pytest.fixture
def device_registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A registry of devices and backends of the test's own, with the device type
    "fake" served by tests/unit/fake_device_plugin.py; the real one comes back after."""
    monkeypatch.setattr(devices, "_TYPES", dict(devices._TYPES))
    monkeypatch.setattr(devices, "_EXTRA_BACKENDS", [])
    monkeypatch.setattr(devices, "_PLUGINS", {"fake": "tests.unit.fake_device_plugin"})
    yield
