"""A device plugin for tests/unit/test_devices.py: what hvdlite.backends.gpu provides
for "cuda", with NumPy as the namespace and a backend that records its creation."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

NAMESPACE = np
PREPARED: list[tuple[str, list]] = []


def prepare(device: str, ready: Sequence[Any]) -> None:
    PREPARED.append((device, list(ready)))


def fence(device: str) -> str:
    return f"fence on {device}"


class FakeBackend:
    name = "fake-plugin"

    def __init__(self, config: Any) -> None:
        self.config = config


BACKENDS = [FakeBackend]
