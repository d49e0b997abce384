"""The runtime's collectives on torch tensors.

CPU tensors cross into the engine as NumPy views of their own memory (no copy;
bfloat16 travels as its bit pattern through ml_dtypes), and results come back
as tensors sharing the NumPy buffers. ``allreduce``, ``allgather`` and
``broadcast`` are differentiable with Horovod's conventions: the gradient of
allreduce is the allreduce of the gradient, and the gradients of allgather and
broadcast are averaged over ranks.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import ml_dtypes
import numpy as np
import torch

import hvdlite as _hvd
from hvdlite.core.ops import GroupHandle
from hvdlite.core.process_sets import ProcessSet

Average, Sum, Min, Max, Product = _hvd.Average, _hvd.Sum, _hvd.Min, _hvd.Max, _hvd.Product

# handle -> (output tensor to return, optional post-processing)
_results: dict[Any, Any] = {}


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A NumPy view of a CPU tensor's memory (no copy)."""
    if tensor.device.type != "cpu":
        raise TypeError(f"hvdlite.torch handles CPU tensors; got a tensor on {tensor.device}. "
                        "Move it with .cpu() (the GPU path is not part of this build).")
    detached = tensor.detach()
    if detached.dtype is torch.bfloat16:
        return detached.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return detached.numpy()


def from_numpy(array: np.ndarray) -> torch.Tensor:
    if array.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def _hold(handle: Any, output: Optional[torch.Tensor]) -> Any:
    _results[handle] = output
    return handle


def poll(handle: Any) -> bool:
    return _hvd.poll(handle)


def synchronize(handle: Any) -> Any:
    """Wait for an async op and return its result as tensor(s)."""
    output = _results.pop(handle, None) if not isinstance(handle, GroupHandle) else [
        _results.pop(h, None) for h in handle.handles]
    result = _hvd.synchronize(handle)
    if isinstance(handle, GroupHandle):
        return [_to_tensor(r, o) for r, o in zip(result, output)]
    return _to_tensor(result, output)


def _to_tensor(result: Any, output: Optional[torch.Tensor]) -> Any:
    if output is not None:
        return output                      # in-place: the caller's tensor now holds it
    if isinstance(result, tuple):
        return tuple(_to_tensor(r, None) for r in result)
    return from_numpy(result) if isinstance(result, np.ndarray) else result


# -- allreduce ---------------------------------------------------------------------------
def allreduce_async(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
                    op: Optional[int] = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0,
                    process_set: Optional[ProcessSet] = None) -> int:
    return _hvd.allreduce_async(to_numpy(tensor), average, name, op, prescale_factor,
                                postscale_factor, process_set)


def allreduce_async_(tensor: torch.Tensor, average: Optional[bool] = None,
                     name: Optional[str] = None, op: Optional[int] = None,
                     prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: Optional[ProcessSet] = None) -> int:
    handle = _hvd.allreduce_async_(to_numpy(tensor), average, name, op, prescale_factor,
                                   postscale_factor, process_set)
    return _hold(handle, tensor)


def allreduce_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
               op: Optional[int] = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0,
               process_set: Optional[ProcessSet] = None) -> torch.Tensor:
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor, process_set))


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, average: Optional[bool], name: Optional[str],
                op: Optional[int], prescale: float, postscale: float,
                process_set: Optional[ProcessSet]) -> torch.Tensor:
        ctx.args = (average, op, prescale, postscale, process_set)
        return synchronize(allreduce_async(tensor, average, name, op, prescale, postscale,
                                           process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        average, op, prescale, postscale, process_set = ctx.args
        reduced = synchronize(allreduce_async(grad.contiguous(), average, None, op, prescale,
                                              postscale, process_set))
        return (reduced,) + (None,) * 6


def allreduce(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
              compression: Any = None, op: Optional[int] = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0,
              process_set: Optional[ProcessSet] = None) -> torch.Tensor:
    """Differentiable allreduce (default op: Average), optionally compressed on the wire."""
    from hvdlite.torch.compression import Compression
    compression = compression or Compression.none
    compressed, context = compression.compress(tensor)
    reduced = _Allreduce.apply(compressed, average, name, op, prescale_factor,
                               postscale_factor, process_set)
    return compression.decompress(reduced, context)


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                            name: Optional[str] = None, op: Optional[int] = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: Optional[ProcessSet] = None) -> GroupHandle:
    return _hvd.grouped_allreduce_async([to_numpy(t) for t in tensors], average, name, op,
                                        prescale_factor, postscale_factor, process_set)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                      name: Optional[str] = None, op: Optional[int] = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: Optional[ProcessSet] = None) -> list[torch.Tensor]:
    return synchronize(grouped_allreduce_async(tensors, average, name, op, prescale_factor,
                                               postscale_factor, process_set))


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                             name: Optional[str] = None, op: Optional[int] = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: Optional[ProcessSet] = None) -> GroupHandle:
    group = _hvd.grouped_allreduce_async_([to_numpy(t) for t in tensors], average, name, op,
                                          prescale_factor, postscale_factor, process_set)
    for handle, tensor in zip(group.handles, tensors):
        _hold(handle, tensor)
    return group


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                       name: Optional[str] = None, op: Optional[int] = None,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: Optional[ProcessSet] = None) -> list[torch.Tensor]:
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set))


# -- allgather, broadcast, alltoall, reducescatter ---------------------------------------------
def allgather_async(tensor: torch.Tensor, name: Optional[str] = None,
                    process_set: Optional[ProcessSet] = None) -> int:
    return _hvd.allgather_async(to_numpy(tensor), name, process_set)


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: Optional[str],
                process_set: Optional[ProcessSet]) -> torch.Tensor:
        ctx.process_set = process_set
        ctx.rows = tensor.shape[0] if tensor.dim() else 1
        return synchronize(allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        reduced = synchronize(allreduce_async(grad.contiguous(), op=Average,
                                              process_set=ctx.process_set))
        rows = _hvd.allgather(np.array([ctx.rows], dtype=np.int64), process_set=ctx.process_set)
        member = _member_rank(ctx.process_set)
        start = int(rows[:member].sum())
        return reduced.narrow(0, start, ctx.rows), None, None


def _member_rank(process_set: Optional[ProcessSet]) -> int:
    return _hvd.rank() if process_set is None else process_set.rank()


def allgather(tensor: torch.Tensor, name: Optional[str] = None,
              process_set: Optional[ProcessSet] = None) -> torch.Tensor:
    """Differentiable; the gradient is averaged over ranks, then this rank's rows kept."""
    return _Allgather.apply(tensor, name, process_set)


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                    process_set: Optional[ProcessSet] = None) -> int:
    return _hvd.broadcast_async(to_numpy(tensor), root_rank, name, process_set)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                     process_set: Optional[ProcessSet] = None) -> int:
    return _hold(_hvd.broadcast_async_(to_numpy(tensor), root_rank, name, process_set), tensor)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
               process_set: Optional[ProcessSet] = None) -> torch.Tensor:
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: Optional[str],
                process_set: Optional[ProcessSet]) -> torch.Tensor:
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        reduced = synchronize(allreduce_async(grad.contiguous(), op=Average,
                                              process_set=ctx.process_set))
        if _member_rank(ctx.process_set) != ctx.root_rank:
            reduced = reduced * 0
        return reduced, None, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
              process_set: Optional[ProcessSet] = None) -> torch.Tensor:
    """Differentiable; the root gets the rank-averaged gradient, others zeros."""
    return _Broadcast.apply(tensor, root_rank, name, process_set)


def alltoall_async(tensor: torch.Tensor, splits: Optional[Any] = None, name: Optional[str] = None,
                   process_set: Optional[ProcessSet] = None) -> int:
    if isinstance(splits, torch.Tensor):
        splits = splits.tolist()
    return _hvd.alltoall_async(to_numpy(tensor), splits, name, process_set)


def alltoall(tensor: torch.Tensor, splits: Optional[Any] = None, name: Optional[str] = None,
             process_set: Optional[ProcessSet] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (received rows, rows received from each rank)."""
    return synchronize(alltoall_async(tensor, splits, name, process_set))


def reducescatter_async(tensor: torch.Tensor, name: Optional[str] = None,
                        op: Optional[int] = None, process_set: Optional[ProcessSet] = None,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> int:
    return _hvd.reducescatter_async(to_numpy(tensor), op, name, process_set, prescale_factor,
                                    postscale_factor)


def reducescatter(tensor: torch.Tensor, name: Optional[str] = None, compression: Any = None,
                  op: Optional[int] = None, process_set: Optional[ProcessSet] = None,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> torch.Tensor:
    from hvdlite.torch.compression import Compression
    compression = compression or Compression.none
    compressed, context = compression.compress(tensor)
    result = synchronize(reducescatter_async(compressed, name, op, process_set,
                                             prescale_factor, postscale_factor))
    return compression.decompress(result, context)


def join(device: int = -1) -> int:
    """Signal this rank is out of data; returns the last rank to join. ``device`` is
    accepted for Horovod compatibility."""
    return _hvd.join()
