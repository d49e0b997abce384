"""The runtime's collectives on torch tensors, generated from the torch adapter
(``hvdlite.api.binding``), with autograd registered on top.

``allreduce``, ``allgather`` and ``broadcast`` are differentiable with
Horovod's conventions: the gradient of allreduce is the allreduce of the
gradient, and the gradients of allgather and broadcast are averaged over ranks.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

import hvdlite as _hvd
from hvdlite.api.binding import make_ops
from hvdlite.api.process_set import ProcessSet
from hvdlite.api.compression import Compression, Compressor
from hvdlite.torch.adapter import TORCH

_OPS = make_ops(TORCH)
allreduce_async = _OPS["allreduce_async"]
allreduce_async_ = _OPS["allreduce_async_"]
allgather_async = _OPS["allgather_async"]
broadcast_async = _OPS["broadcast_async"]
broadcast_async_ = _OPS["broadcast_async_"]
synchronize = _OPS["synchronize"]
Average = _hvd.Average


def _member_rank(process_set: Optional[ProcessSet]) -> int:
    return _hvd.rank() if process_set is None else process_set.rank()


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
        reduced = synchronize(allreduce_async(grad, average, None, op, prescale, postscale,
                                              process_set))
        return (reduced,) + (None,) * 6


def allreduce(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
              compression: Optional[type[Compressor]] = None, op: Optional[int] = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: Optional[ProcessSet] = None) -> torch.Tensor:
    """Differentiable allreduce (default op: Average), optionally compressed on the wire."""
    TORCH.require(tensor, "allreduce")
    compression = compression or Compression.none
    compressed, context = compression.compress(tensor)
    reduced = _Allreduce.apply(compressed, average, name, op, prescale_factor,
                               postscale_factor, process_set)
    return compression.decompress(reduced, context)


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: Optional[str],
                process_set: Optional[ProcessSet]) -> torch.Tensor:
        ctx.process_set = process_set
        ctx.rows = tensor.shape[0] if tensor.dim() else 1
        return synchronize(allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        reduced = synchronize(allreduce_async(grad, op=Average, process_set=ctx.process_set))
        rows = _hvd.allgather(np.array([ctx.rows], dtype=np.int64), process_set=ctx.process_set)
        start = int(rows[:_member_rank(ctx.process_set)].sum())
        return reduced.narrow(0, start, ctx.rows), None, None


def allgather(tensor: torch.Tensor, name: Optional[str] = None,
              process_set: Optional[ProcessSet] = None) -> torch.Tensor:
    """Differentiable; the gradient is averaged over ranks, then this rank's rows kept."""
    TORCH.require(tensor, "allgather")
    return _Allgather.apply(tensor, name, process_set)


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: Optional[str],
                process_set: Optional[ProcessSet]) -> torch.Tensor:
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        reduced = synchronize(allreduce_async(grad, op=Average, process_set=ctx.process_set))
        if _member_rank(ctx.process_set) != ctx.root_rank:
            reduced = reduced * 0
        return reduced, None, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
              process_set: Optional[ProcessSet] = None) -> torch.Tensor:
    """Differentiable; the root gets the rank-averaged gradient, others zeros."""
    TORCH.require(tensor, "broadcast")
    return _Broadcast.apply(tensor, root_rank, name, process_set)


# The generated op set, with the differentiable forms above in place of the plain ones.
OPS: dict[str, Any] = dict(_OPS, allreduce=allreduce, allgather=allgather, broadcast=broadcast)
