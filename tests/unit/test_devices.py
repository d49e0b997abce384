"""The device registry, without a GPU: plugins load on first use and register their
namespace, stream hooks and backends; unknown devices are refused by name."""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from hvdlite.engine import devices
from tests.unit import fake_device_plugin as plugin


pytestmark = pytest.mark.usefixtures("device_registry")


def test_a_plugin_loads_once_on_first_use_with_its_hooks_and_backends() -> None:
    assert "fake" not in devices._TYPES
    assert devices.load("fake") is True
    assert devices.backend_factories() == [plugin.FakeBackend]
    described = devices.described("fake:3")
    assert described.namespace is np and devices.array_namespace("fake:0") is np
    described.prepare("fake:3", ["event"])
    assert plugin.PREPARED[-1] == ("fake:3", ["event"])
    assert described.fence("fake:3") == "fence on fake:3"
    assert devices.load("fake") is True                  # already there: nothing again
    assert devices.backend_factories() == [plugin.FakeBackend]


def test_unknown_devices_are_refused_by_name() -> None:
    assert devices.load("tpu") is False
    with pytest.raises(LookupError, match="'tpu:0'"):
        devices.described("tpu:0")
    assert devices.backend_factories() == []


def test_described_loads_the_plugin_it_needs() -> None:
    assert devices.described("fake:1").namespace is np
    assert devices.backend_factories() == [plugin.FakeBackend]


def test_cpu_needs_no_plugin_and_has_no_stream_hooks() -> None:
    cpu = devices.described("cpu")
    assert cpu.namespace is np and cpu.fence("cpu") is None
    assert cpu.prepare("cpu", []) is None and devices.device_type("cpu") == "cpu"
    assert devices.device_type("cuda:1") == "cuda"


def test_ready_events_skip_joined_ranks_and_host_tensors() -> None:
    class Req:
        def __init__(self, ready: Any) -> None:
            self.ready = ready
    assert devices.ready_events([Req("a"), None, Req(None), Req("b")]) == ["a", "b"]


def test_device_types_and_fenced_results_are_immutable_values() -> None:
    fenced = devices.Fenced("value", "fence")
    with pytest.raises(dataclasses.FrozenInstanceError):
        fenced.fence = "another"                         # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        devices.DeviceType(np).namespace = None          # type: ignore[misc]
