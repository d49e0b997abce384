"""The runtime's collectives on torch tensors, generated from the torch adapter
(``hvdlite.api.binding``), with autograd registered on top.

Every collective that returns a tensor is differentiable, with Horovod's
conventions: the gradient of allreduce is the allreduce of the gradient; the
gradients of allgather and broadcast are averaged over ranks; the gradient of
alltoall is the alltoall of the gradient back along the received splits; the
gradient of reducescatter is the allgather of the gradient (divided by the set
size for Average). The grouped forms are differentiable per tensor.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np
import torch

import hvdlite as _hvd
from hvdlite.api.binding import make_ops
from hvdlite.api.process_set import ProcessSet
from hvdlite.api.compression import Compressor, compressed, compressed_all
from hvdlite.errors import UsageError
from hvdlite.torch.adapter import TORCH
from hvdlite.torch.sparse import SparseHandle, sparse_allreduce_async

_OPS = make_ops(TORCH)
allreduce_async = _OPS["allreduce_async"]
allreduce_async_ = _OPS["allreduce_async_"]
allgather_async = _OPS["allgather_async"]
broadcast_async = _OPS["broadcast_async"]
broadcast_async_ = _OPS["broadcast_async_"]
alltoall_async = _OPS["alltoall_async"]
reducescatter_async = _OPS["reducescatter_async"]
grouped_allreduce_async = _OPS["grouped_allreduce_async"]
grouped_allgather_async = _OPS["grouped_allgather_async"]
grouped_reducescatter_async = _OPS["grouped_reducescatter_async"]
synchronize = _OPS["synchronize"]
Average = _hvd.Average


def _member_rank(process_set: Optional[ProcessSet]) -> int:
    return _hvd.rank() if process_set is None else process_set.rank()


def _set_size(process_set: Optional[ProcessSet]) -> int:
    return _hvd.size() if process_set is None else process_set.size()


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
    return compressed(compression, tensor, lambda wire: _Allreduce.apply(
        wire, average, name, op, prescale_factor, postscale_factor, process_set))


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
        if _hvd.rank() != ctx.root_rank:        # a global rank, as in Horovod
            reduced = reduced * 0
        return reduced, None, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
              process_set: Optional[ProcessSet] = None) -> torch.Tensor:
    """Differentiable; the root gets the rank-averaged gradient, others zeros."""
    TORCH.require(tensor, "broadcast")
    return _Broadcast.apply(tensor, root_rank, name, process_set)




class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: Optional[str],
                process_set: Optional[ProcessSet]) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.process_set, ctx.input_shape = process_set, tensor.shape
        received, received_splits = synchronize(alltoall_async(tensor, splits, name,
                                                               process_set))
        ctx.received_splits = received_splits
        ctx.mark_non_differentiable(received_splits)
        return received, received_splits

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _splits_grad: Any) -> tuple:
        # Send each received row's gradient back to the rank it came from: the
        # rows come back in the order this rank sent them.
        returned, _ = synchronize(alltoall_async(grad.contiguous(), ctx.received_splits,
                                                 process_set=ctx.process_set))
        return returned.reshape(ctx.input_shape), None, None, None


def _explicit_splits(tensor: torch.Tensor, process_set: Optional[ProcessSet]) -> Any:
    """Even splits spelled out, so the forward learns the received splits the
    backward needs; None (the core's own check and message) when they don't exist."""
    size = _set_size(process_set)
    if tensor.dim() == 0 or tensor.shape[0] % size:
        return None
    return [tensor.shape[0] // size] * size


def alltoall(tensor: torch.Tensor, splits: Any = None, name: Optional[str] = None,
             process_set: Optional[ProcessSet] = None) -> Any:
    """Differentiable alltoall: send ``splits[i]`` rows to rank i (even split when
    None). Returns the received rows, and with ``splits`` given ``(received, rows
    received per rank)``; the received splits are not differentiable."""
    if not TORCH.is_tensor(tensor):   # the generated op refuses it on every rank
        return _OPS["alltoall"](tensor, splits, name, process_set)
    chosen = splits if splits is not None else _explicit_splits(tensor, process_set)
    if chosen is None:   # let the core raise (and tell the peers) with its own message
        return synchronize(alltoall_async(tensor, None, name, process_set))
    received, received_splits = _Alltoall.apply(tensor, chosen, name, process_set)
    return received if splits is None else (received, received_splits)


def _gather_scale(op: Optional[int], prescale: float, postscale: float,
                  process_set: Optional[ProcessSet]) -> float:
    """The factor on the allgathered gradient, by Horovod's convention (its
    HorovodReducescatter.backward): Sum multiplies by the set size, Average not,
    and the scale factors apply. That is the size times the gradient of the sum
    of every rank's loss, the same convention as Horovod's allreduce gradient."""
    reduction = _hvd.Average if op is None else op
    if reduction not in (_hvd.Average, _hvd.Sum):
        raise UsageError("reducescatter is differentiable only for op=Average or Sum")
    scale = prescale * postscale
    return scale * _set_size(process_set) if reduction == _hvd.Sum else scale


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: Optional[str], op: Optional[int],
                process_set: Optional[ProcessSet], prescale: float,
                postscale: float) -> torch.Tensor:
        ctx.process_set = process_set
        ctx.args = (op, prescale, postscale, process_set)
        return synchronize(reducescatter_async(tensor, name, op, process_set, prescale,
                                               postscale))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        scale = _gather_scale(*ctx.args)
        gathered = synchronize(allgather_async(grad.contiguous(), process_set=ctx.process_set))
        return (gathered * scale if scale != 1.0 else gathered), None, None, None, None, None


def reducescatter(tensor: torch.Tensor, name: Optional[str] = None,
                  compression: Optional[type[Compressor]] = None, op: Optional[int] = None,
                  process_set: Optional[ProcessSet] = None, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """Differentiable reducescatter; the gradient is the allgather of the gradient
    (multiplied by the set size for op=Sum), as in Horovod."""
    if not TORCH.is_tensor(tensor):   # the generated op refuses it on every rank
        return _OPS["reducescatter"](tensor, name, compression, op, process_set,
                                     prescale_factor, postscale_factor)
    return compressed(compression, tensor, lambda wire: _Reducescatter.apply(
        wire, name, op, process_set, prescale_factor, postscale_factor))


def _all_tensors(tensors: list[Any]) -> bool:
    """True for a non-empty list of tensors: what the autograd forms handle."""
    return bool(tensors) and all(TORCH.is_tensor(t) for t in tensors)


# -- grouped forms: one Function over all the tensors, so the forward submits every
# -- op before waiting (they negotiate and fuse together) and so does the backward.
class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, args: tuple, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        average, name, op, prescale, postscale, process_set = args
        ctx.args = (average, op, prescale, postscale, process_set)
        return tuple(synchronize(grouped_allreduce_async(
            list(tensors), average, name, op, prescale, postscale, process_set)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        average, op, prescale, postscale, process_set = ctx.args
        reduced = synchronize(grouped_allreduce_async(
            [g.contiguous() for g in grads], average, None, op, prescale, postscale,
            process_set))
        return (None, *reduced)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                      name: Optional[str] = None,
                      compression: Optional[type[Compressor]] = None,
                      op: Optional[int] = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0,
                      process_set: Optional[ProcessSet] = None) -> list[torch.Tensor]:
    """Differentiable per tensor; the ops are named ``<name>.<i>``."""
    tensors = list(tensors)
    if not _all_tensors(tensors):   # the generated op refuses them on every rank
        return _OPS["grouped_allreduce"](tensors, average, name, compression, op,
                                         prescale_factor, postscale_factor, process_set)
    args = (average, name, op, prescale_factor, postscale_factor, process_set)
    return compressed_all(compression, tensors,
                          lambda wires: _GroupedAllreduce.apply(args, *wires))


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, args: tuple, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        name, process_set = args
        ctx.process_set = process_set
        ctx.rows = [t.shape[0] if t.dim() else 1 for t in tensors]
        ctx.shapes = [t.shape for t in tensors]
        return tuple(synchronize(grouped_allgather_async(list(tensors), name, process_set)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        # As for allgather: average over ranks, keep this rank's rows (one exchange
        # of the row counts for the whole group).
        reduced = synchronize(grouped_allreduce_async(
            [g.contiguous() for g in grads], op=Average, process_set=ctx.process_set))
        rows = _hvd.allgather(np.array([ctx.rows], dtype=np.int64),
                              process_set=ctx.process_set)
        starts = rows[:_member_rank(ctx.process_set)].sum(axis=0)
        mine = [r.narrow(0, int(s), n) for r, s, n in zip(reduced, starts, ctx.rows)]
        return (None, *[m.reshape(shape) for m, shape in zip(mine, ctx.shapes)])


def grouped_allgather(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                      process_set: Optional[ProcessSet] = None) -> list[torch.Tensor]:
    """Differentiable per tensor (as ``allgather``); the ops are named ``<name>.<i>``."""
    tensors = list(tensors)
    if not _all_tensors(tensors):   # the generated op refuses them on every rank
        return _OPS["grouped_allgather"](tensors, name, process_set)
    return list(_GroupedAllgather.apply((name, process_set), *tensors))


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, args: tuple, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        name, op, process_set, prescale, postscale = args
        ctx.args = (op, prescale, postscale, process_set)
        return tuple(synchronize(grouped_reducescatter_async(
            list(tensors), name, op, process_set, prescale, postscale)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        scale = _gather_scale(*ctx.args)
        gathered = synchronize(grouped_allgather_async([g.contiguous() for g in grads],
                                                       process_set=ctx.args[3]))
        return (None, *[g * scale if scale != 1.0 else g for g in gathered])


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                          compression: Optional[type[Compressor]] = None,
                          op: Optional[int] = None, process_set: Optional[ProcessSet] = None,
                          prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """Differentiable per tensor (as ``reducescatter``); the ops are named ``<name>.<i>``."""
    tensors = list(tensors)
    if not _all_tensors(tensors):   # the generated op refuses them on every rank
        return _OPS["grouped_reducescatter"](tensors, name, compression, op, process_set,
                                             prescale_factor, postscale_factor)
    args = (name, op, process_set, prescale_factor, postscale_factor)
    return compressed_all(compression, tensors,
                          lambda wires: _GroupedReducescatter.apply(args, *wires))


_plain_synchronize = _OPS["synchronize"]
_plain_poll = _OPS["poll"]


def synchronize(handle: Any) -> Any:  # noqa: F811 (extends the generated one)
    """Wait for an async op and return its result; a ``SparseHandle`` gives the
    reduced sparse tensor."""
    if isinstance(handle, SparseHandle):
        return handle.result()
    return _plain_synchronize(handle)


def poll(handle: Any) -> bool:
    """True once ``synchronize(handle)`` would return without waiting."""
    if isinstance(handle, SparseHandle):
        return _plain_poll(handle.indices) and _plain_poll(handle.values)
    return _plain_poll(handle)


# The generated op set, with the differentiable forms above in place of the plain ones.
OPS: dict[str, Any] = dict(
    _OPS, synchronize=synchronize, poll=poll, sparse_allreduce_async=sparse_allreduce_async,
    allreduce=allreduce, allgather=allgather, broadcast=broadcast, alltoall=alltoall,
    reducescatter=reducescatter, grouped_allreduce=grouped_allreduce,
    grouped_allgather=grouped_allgather, grouped_reducescatter=grouped_reducescatter)
