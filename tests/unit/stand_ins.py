"""Stand-ins that test_batches.py and test_gradients.py share: a GPU tensor as the
API's adapters see one, without a GPU (a NumPy array that its adapter reports on
"cuda:0"), so the GPU paths (ready events, buckets) run on this machine; and an
engine that records which submissions came in one ``batch()``."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import numpy as np

from hvdlite.api import adapter as adapters


class StandInGpuTensor:
    def __init__(self, array: np.ndarray) -> None:
        self.array = array


class StandInGpuAdapter(adapters.TensorAdapter):
    framework = "stand-in-gpu"

    def is_tensor(self, obj: Any) -> bool:
        return isinstance(obj, StandInGpuTensor)

    def to_array(self, tensor: Any) -> Any:
        return tensor.array

    def device(self, tensor: Any) -> str:
        return "cuda:0"


class BatchingEngine:
    """Records each ``batch()``: what the test appends to ``current`` inside it."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.current: Optional[list[str]] = None

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        self.current = []
        yield
        self.batches.append(self.current)
        self.current = None
