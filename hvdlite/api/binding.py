"""The binding factory: one framework's public op set, generated from its adapter.

``make_ops(adapter)`` returns every collective with Horovod's signatures: the
blocking form, ``*_async`` (a handle for ``synchronize``/``poll``), the
in-place ``*_`` and ``*_async_`` forms, and the grouped forms. A binding
writes only its adapter, its autograd/gradient registration (by wrapping the
generated ops) and its optimizer, so bindings cannot drift apart: a collective
added to the core appears in every binding at once (a test checks the exports).
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from hvdlite.api import collectives as c
from hvdlite.api import submission
from hvdlite.api.adapter import TensorAdapter
from hvdlite.api.process_set import ProcessSet
from hvdlite.api.compression import Compressor, compressed, compressed_all

# Every name make_ops returns; the public API of each binding includes them all.
OP_NAMES = (
    "allreduce", "allreduce_async", "allreduce_", "allreduce_async_",
    "grouped_allreduce", "grouped_allreduce_async", "grouped_allreduce_",
    "grouped_allreduce_async_",
    "allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async",
    "broadcast", "broadcast_async", "broadcast_", "broadcast_async_",
    "alltoall", "alltoall_async",
    "reducescatter", "reducescatter_async", "grouped_reducescatter",
    "grouped_reducescatter_async",
    "synchronize", "poll", "join", "barrier",
)
PS = Optional[ProcessSet]


def make_ops(adapter: TensorAdapter) -> dict[str, Callable[..., Any]]:
    """The public collectives on ``adapter``'s tensors, by name (see OP_NAMES)."""
    a = adapter
    sync = submission.synchronize

    def allreduce_async(tensor: Any, average: Optional[bool] = None, name: Optional[str] = None,
                        op: Optional[int] = None, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0, process_set: PS = None) -> int:
        """Start ``allreduce``; returns a handle for ``synchronize`` or ``poll``."""
        return c.allreduce_async(a, tensor, average, name, op, prescale_factor,
                                 postscale_factor, process_set)

    def allreduce_async_(tensor: Any, average: Optional[bool] = None, name: Optional[str] = None,
                         op: Optional[int] = None, prescale_factor: float = 1.0,
                         postscale_factor: float = 1.0, process_set: PS = None) -> int:
        """Start an in-place ``allreduce`` of ``tensor``; returns a handle."""
        return c.allreduce_async(a, tensor, average, name, op, prescale_factor,
                                 postscale_factor, process_set, inplace=True)

    def allreduce(tensor: Any, average: Optional[bool] = None, name: Optional[str] = None,
                  compression: Optional[type[Compressor]] = None, op: Optional[int] = None,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                  process_set: PS = None) -> Any:
        """Reduce ``tensor`` across the process set (default op: Average)."""
        if compression is None:      # the common case, without two more calls
            return sync(c.allreduce_async(a, tensor, average, name, op, prescale_factor,
                                          postscale_factor, process_set))
        return compressed(compression, tensor, lambda wire: sync(allreduce_async(
            wire, average, name, op, prescale_factor, postscale_factor, process_set)))

    def allreduce_(tensor: Any, average: Optional[bool] = None, name: Optional[str] = None,
                   op: Optional[int] = None, prescale_factor: float = 1.0,
                   postscale_factor: float = 1.0, process_set: PS = None) -> Any:
        """Reduce ``tensor`` in place across the process set; returns it."""
        return sync(c.allreduce_async(a, tensor, average, name, op, prescale_factor,
                                      postscale_factor, process_set, inplace=True))

    def grouped_allreduce_async(tensors: Sequence[Any], average: Optional[bool] = None,
                                name: Optional[str] = None, op: Optional[int] = None,
                                prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                                process_set: PS = None) -> submission.GroupHandle:
        """Start one ``allreduce`` per tensor, negotiated as a group; returns a group handle."""
        return c.grouped_allreduce(a, allreduce_async, tensors, name, False, process_set,
                                   average=average, op=op, prescale_factor=prescale_factor,
                                   postscale_factor=postscale_factor)

    def grouped_allreduce_async_(tensors: Sequence[Any], average: Optional[bool] = None,
                                 name: Optional[str] = None, op: Optional[int] = None,
                                 prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                                 process_set: PS = None) -> submission.GroupHandle:
        """Start an in-place ``allreduce`` per tensor, as a group; returns a group handle."""
        return c.grouped_allreduce(a, allreduce_async_, tensors, name, True, process_set,
                                   average=average, op=op, prescale_factor=prescale_factor,
                                   postscale_factor=postscale_factor)

    def grouped_allreduce(tensors: Sequence[Any], average: Optional[bool] = None,
                          name: Optional[str] = None,
                          compression: Optional[type[Compressor]] = None,
                          op: Optional[int] = None, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0, process_set: PS = None) -> list[Any]:
        """Reduce each tensor across the process set, as one group; returns the list."""
        return compressed_all(compression, tensors, lambda wires: sync(grouped_allreduce_async(
            wires, average, name, op, prescale_factor, postscale_factor, process_set)))

    def grouped_allreduce_(tensors: Sequence[Any], average: Optional[bool] = None,
                           name: Optional[str] = None, op: Optional[int] = None,
                           prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                           process_set: PS = None) -> list[Any]:
        """Reduce each tensor in place, as one group; returns them."""
        return sync(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                             postscale_factor, process_set))

    def allgather_async(tensor: Any, name: Optional[str] = None, process_set: PS = None) -> int:
        """Start ``allgather``; returns a handle for ``synchronize`` or ``poll``."""
        return c.allgather_async(a, tensor, name, process_set)

    def allgather(tensor: Any, name: Optional[str] = None, process_set: PS = None) -> Any:
        """Concatenate every rank's tensor along the first dimension (which may differ)."""
        return sync(allgather_async(tensor, name, process_set))

    def grouped_allgather_async(tensors: Sequence[Any], name: Optional[str] = None,
                                process_set: PS = None) -> submission.GroupHandle:
        """Start one ``allgather`` per tensor, as a group; returns a group handle."""
        return c.grouped(a, allgather_async, tensors, name, "allgather", process_set)

    def grouped_allgather(tensors: Sequence[Any], name: Optional[str] = None,
                          process_set: PS = None) -> list[Any]:
        """Allgather each tensor, as one group; returns the list."""
        return sync(grouped_allgather_async(tensors, name, process_set))

    def broadcast_async(tensor: Any, root_rank: int, name: Optional[str] = None,
                        process_set: PS = None) -> int:
        """Start ``broadcast``; returns a handle for ``synchronize`` or ``poll``."""
        return c.broadcast_async(a, tensor, root_rank, name, process_set)

    def broadcast_async_(tensor: Any, root_rank: int, name: Optional[str] = None,
                         process_set: PS = None) -> int:
        """Start an in-place ``broadcast`` into ``tensor``; returns a handle."""
        return c.broadcast_async(a, tensor, root_rank, name, process_set, inplace=True)

    def broadcast(tensor: Any, root_rank: int, name: Optional[str] = None,
                  process_set: PS = None) -> Any:
        """Every rank receives ``root_rank``'s tensor (``root_rank`` is a global rank, as
        in Horovod, and must be a member of the process set)."""
        return sync(broadcast_async(tensor, root_rank, name, process_set))

    def broadcast_(tensor: Any, root_rank: int, name: Optional[str] = None,
                   process_set: PS = None) -> Any:
        """Overwrite ``tensor`` with ``root_rank``'s; returns it."""
        return sync(broadcast_async_(tensor, root_rank, name, process_set))

    def alltoall_async(tensor: Any, splits: Any = None, name: Optional[str] = None,
                       process_set: PS = None) -> int:
        """Start ``alltoall``; returns a handle for ``synchronize`` or ``poll``."""
        return c.alltoall_async(a, tensor, splits, name, process_set)

    def alltoall(tensor: Any, splits: Any = None, name: Optional[str] = None,
                 process_set: PS = None) -> Any:
        """Send ``splits[i]`` rows to rank i (even split when None). Returns the received
        rows, and with ``splits`` given ``(received, rows received per rank)``."""
        return sync(alltoall_async(tensor, splits, name, process_set))

    def reducescatter_async(tensor: Any, name: Optional[str] = None, op: Optional[int] = None,
                            process_set: PS = None, prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0) -> int:
        """Start ``reducescatter``; returns a handle for ``synchronize`` or ``poll``."""
        return c.reducescatter_async(a, tensor, name, op, process_set, prescale_factor,
                                     postscale_factor)

    def reducescatter(tensor: Any, name: Optional[str] = None,
                      compression: Optional[type[Compressor]] = None, op: Optional[int] = None,
                      process_set: PS = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0) -> Any:
        """Reduce across ranks, then rank i keeps the i-th block of rows; with n rows
        and P ranks the first n % P ranks get one row more."""
        return compressed(compression, tensor, lambda wire: sync(reducescatter_async(
            wire, name, op, process_set, prescale_factor, postscale_factor)))

    def grouped_reducescatter_async(tensors: Sequence[Any], name: Optional[str] = None,
                                    op: Optional[int] = None, process_set: PS = None,
                                    prescale_factor: float = 1.0,
                                    postscale_factor: float = 1.0) -> submission.GroupHandle:
        """Start one ``reducescatter`` per tensor, as a group; returns a group handle."""
        return c.grouped(a, reducescatter_async, tensors, name, "reducescatter", process_set,
                         op=op, prescale_factor=prescale_factor,
                         postscale_factor=postscale_factor)

    def grouped_reducescatter(tensors: Sequence[Any], name: Optional[str] = None,
                              compression: Optional[type[Compressor]] = None,
                              op: Optional[int] = None, process_set: PS = None,
                              prescale_factor: float = 1.0,
                              postscale_factor: float = 1.0) -> list[Any]:
        """Reducescatter each tensor, as one group; returns the list."""
        return compressed_all(compression, tensors, lambda wires: sync(
            grouped_reducescatter_async(wires, name, op, process_set, prescale_factor,
                                        postscale_factor)))

    def join(device: int = -1) -> int:
        """Signal this rank is out of data; returns the last rank to join. ``device``
        is accepted for Horovod compatibility."""
        return c.join()

    ops = dict(locals())
    ops.update(synchronize=submission.synchronize, poll=submission.poll, barrier=c.barrier)
    return {name: _tag(ops[name], adapter) for name in OP_NAMES}


def _tag(function: Callable[..., Any], adapter: TensorAdapter) -> Callable[..., Any]:
    """Name the generated function after the binding (for help() and tracebacks);
    the runtime's own functions (synchronize, poll, barrier) keep their names."""
    if getattr(function, "__module__", None) != __name__:
        return function
    module = "hvdlite" if adapter.framework == "numpy" else f"hvdlite.{adapter.framework}"
    function.__module__ = module
    function.__qualname__ = function.__name__
    return function


__all__ = ["OP_NAMES", "make_ops"]
