"""Stand-ins that test_batches.py and test_reducer.py share: a GPU tensor as the
API's adapters see one, without a GPU (a NumPy array that its adapter reports on
"cuda:0"), so the GPU paths (ready events, buckets on the device) run on this
machine; and an engine that records which submissions came in one ``batch()``."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import numpy as np

from hvdlite.api import adapter as adapters


class StandInGpuTensor:
    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    def __getitem__(self, index: Any) -> "StandInGpuTensor":
        return StandInGpuTensor(self.array[index])

    def __setitem__(self, index: Any, value: Any) -> None:
        self.array[index] = value


class StandInGpuAdapter(adapters.TensorAdapter):
    framework = "stand-in-gpu"

    def is_tensor(self, obj: Any) -> bool:
        return isinstance(obj, StandInGpuTensor)

    def to_array(self, tensor: Any) -> Any:
        return tensor.array

    def device(self, tensor: Any) -> str:
        return "cuda:0"

    def dtype_name(self, tensor: Any) -> str:
        return tensor.array.dtype.name

    # Gradient buckets on the "device": flat buffers of its own tensors, as torch's.
    @property
    def buffers(self) -> "StandInGpuAdapter":
        return self

    def flat_buffer(self, dtype: str, device: str, count: int) -> StandInGpuTensor:
        assert device == "cuda:0", device
        return StandInGpuTensor(np.zeros(count, dtype))

    def view(self, flat: Any, offset: int, shape: tuple[int, ...]) -> StandInGpuTensor:
        return StandInGpuTensor(super().view(flat.array, offset, shape))

    def pack(self, tensors: Any, flat: Any) -> None:
        super().pack(tensors, flat.array)

    def unpack(self, flat: Any, shapes: Any) -> list[StandInGpuTensor]:
        return [StandInGpuTensor(a) for a in adapters.NUMPY.unpack(flat.array, shapes)]


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
