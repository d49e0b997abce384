"""The CUDA device plugin: CuPy as the array namespace, one dedicated stream per
GPU, and three backends: NCCL first (torch's on the torch transport, CuPy's on
MPI), then host staging through pinned memory.

Loaded by ``hvdlite.engine.devices`` the first time a request names a "cuda"
device (importing it imports CuPy); it reads NAMESPACE, prepare, fence and
BACKENDS from here, so this module never imports the core. Ordering without host synchronisation:
the engine's stream waits on an event recorded on the framework's stream at
submission (``prepare``); results carry an event recorded after they are
written (``fence``), which the framework's stream waits on before use.
"""
from __future__ import annotations

from typing import Any, Sequence

import cupy

from hvdlite.backends.cuda import device_index, stream_for
from hvdlite.backends.nccl import NCCL_AVAILABLE, NcclBackend
from hvdlite.backends.staged import StagedBackend
from hvdlite.backends.torch_nccl import TorchNcclBackend

NAMESPACE = cupy


def prepare(device: str, ready: Sequence[Any]) -> None:
    index = device_index(device)
    cupy.cuda.Device(index).use()
    stream = stream_for(index)
    stream.use()                      # the engine thread's cupy work runs on it, in order
    for event in ready:
        cupy.cuda.runtime.streamWaitEvent(stream.ptr, event.ptr, 0)


def fence(device: str) -> Any:
    event = cupy.cuda.Event(disable_timing=True)
    event.record(stream_for(device_index(device)))
    return event


# In order of preference: torch's NCCL for sets on the torch transport (torchrun), CuPy's
# NCCL for MPI's where it loads, then staging (always correct).
BACKENDS = [TorchNcclBackend] + ([NcclBackend] if NCCL_AVAILABLE else []) + [StagedBackend]
