"""Start-of-training synchronization: parameters, optimizer state, objects."""
from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional, Union

import torch

import hvdlite as _hvd
from hvdlite.api.process_set import ProcessSet
from hvdlite.errors import StateError, UsageError
from hvdlite.torch.ops import broadcast_async_, synchronize
from hvdlite.torch.zero import ZeroRedundancyOptimizer

Params = Union[Mapping[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]]


def broadcast_parameters(params: Params, root_rank: int,
                         process_set: Optional[ProcessSet] = None) -> None:
    """Overwrite every rank's tensors with ``root_rank``'s, in place.

    ``params`` is a ``state_dict()`` or ``named_parameters()``. All broadcasts are
    issued before any is awaited, so they are negotiated and run together.
    """
    items = sorted(params.items()) if isinstance(params, Mapping) else list(params)
    handles = []
    for name, tensor in items:
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"broadcast_parameters: '{name}' is a {type(tensor).__name__}, "
                             "not a tensor; pass model.state_dict() or named_parameters()")
        handles.append(broadcast_async_(tensor.data, root_rank, name=f"broadcast.{name}",
                                        process_set=process_set))
    for handle in handles:
        synchronize(handle)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int,
                              process_set: Optional[ProcessSet] = None) -> None:
    """Make every rank's optimizer state and hyperparameters equal to ``root_rank``'s.

    Ranks load the root's ``state_dict()``: its structure and Python scalars travel
    as one pickled object, its tensors as tensor broadcasts. Unlike Horovod, no
    dummy ``step()`` creates missing state, so parameters are never touched (a dummy
    AdamW step would weight-decay them and silently make ranks diverge).
    """
    if isinstance(optimizer, ZeroRedundancyOptimizer):     # alike on every rank: no round
        raise UsageError(
            f"rank {_hvd.rank()}: broadcast_optimizer_state() got a ZeroRedundancyOptimizer, "
            "whose state is sharded: each rank holds its own share, so there is no whole "
            "state to broadcast. broadcast_parameters() makes every rank start alike; a "
            "state moves with consolidate_state_dict(), state_dict() and load_state_dict()")
    is_root = (process_set.rank() if process_set else _hvd.rank()) == root_rank
    skeleton, tensors, failure = None, [], None
    if is_root:
        try:
            skeleton, tensors = _split_tensors(optimizer.state_dict())
        except Exception as exc:   # every rank must hear of it, or the others wait below
            failure = exc
    skeleton, told = _hvd.broadcast_object(
        (skeleton, None if failure is None else f"{type(failure).__name__}: {failure}"),
        root_rank, name="optimizer_state.skeleton", process_set=process_set)
    if told is not None:
        raise StateError(f"rank {_hvd.rank()}: broadcast_optimizer_state(): the root rank "
                         f"{root_rank}'s optimizer.state_dict() failed: {told}") from failure
    specs = _hvd.broadcast_object([(t.dtype, tuple(t.shape)) for t in tensors], root_rank,
                                  name="optimizer_state.specs", process_set=process_set)
    if not is_root:
        tensors = [torch.empty(shape, dtype=dtype) for dtype, shape in specs]
    handles = [broadcast_async_(t, root_rank, name=f"optimizer_state.{i}", process_set=process_set)
               for i, t in enumerate(tensors)]
    for handle in handles:
        synchronize(handle)
    if not is_root:
        optimizer.load_state_dict(_join_tensors(skeleton, tensors))


class _TensorSlot:
    """Stands in for the i-th tensor in a pickled state_dict skeleton."""

    def __init__(self, index: int) -> None:
        self.index = index


def _split_tensors(value: Any, found: Optional[list[torch.Tensor]] = None) -> tuple[Any, list]:
    found = [] if found is None else found
    if isinstance(value, torch.Tensor):
        found.append(value.detach().cpu().contiguous())
        return _TensorSlot(len(found) - 1), found
    if isinstance(value, dict):
        return {k: _split_tensors(v, found)[0] for k, v in value.items()}, found
    if isinstance(value, (list, tuple)):
        return type(value)(_split_tensors(v, found)[0] for v in value), found
    return value, found


def _join_tensors(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, _TensorSlot):
        return tensors[value.index]
    if isinstance(value, dict):
        return {k: _join_tensors(v, tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_join_tensors(v, tensors) for v in value)
    return value


def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None,
                     process_set: Optional[ProcessSet] = None) -> Any:
    return _hvd.broadcast_object(obj, root_rank, name, process_set)


def allgather_object(obj: Any, name: Optional[str] = None,
                     process_set: Optional[ProcessSet] = None) -> list[Any]:
    return _hvd.allgather_object(obj, name, process_set)
