"""CUDA streams and events for the GPU backends (imports CuPy)."""
from __future__ import annotations

from typing import Any

import cupy

_STREAMS: dict[int, Any] = {}


def device_index(device: str) -> int:
    return int(device.split(":", 1)[1]) if ":" in device else 0


def stream_for(index: int) -> Any:
    """The engine's stream on GPU ``index``: non-blocking, so it never waits on the
    legacy default stream the framework may be computing on."""
    stream = _STREAMS.get(index)
    if stream is None:
        with cupy.cuda.Device(index):
            stream = _STREAMS[index] = cupy.cuda.Stream(non_blocking=True)
    return stream


def current_stream() -> Any:
    return stream_for(cupy.cuda.Device().id)


class StreamWork:
    """Work queued on a stream: done once an event recorded after it has fired.
    ``ordered``: whatever the engine queues next on that stream runs after it, so
    the executor need not wait for it (see ``Work`` in hvdlite.backends.base)."""
    __slots__ = ("event",)
    ordered = True

    def __init__(self, stream: Any) -> None:
        self.event = cupy.cuda.Event(disable_timing=True)
        self.event.record(stream)

    def done(self) -> bool:
        return self.event.done

    def wait(self) -> None:
        self.event.synchronize()
