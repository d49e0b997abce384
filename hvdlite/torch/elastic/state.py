"""``TorchState``: a model, an optimizer, samplers and plain values, committed and
restored together. Models, optimizers and ElasticSamplers go through their
``state_dict`` (committed as the tensors' raw bytes: a restore is bitwise); any other
keyword argument (``epoch=0, batch=0``) is a plain attribute. A
``ZeroRedundancyOptimizer``'s state is whole on rank 0 only (its handler, below)."""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from hvdlite.elastic.state import Handler, ObjectState
from hvdlite.errors import UsageError
from hvdlite.torch.elastic.sampler import ElasticSampler
from hvdlite.torch.functions import (broadcast_object, broadcast_optimizer_state,
                                     broadcast_parameters)
from hvdlite.api.process_set import global_process_set
from hvdlite.api.runtime import rank
from hvdlite.torch.zero import ZeroRedundancyOptimizer


class _StateDictHandler(Handler):
    """An object with ``state_dict``/``load_state_dict``; the object itself stays."""

    def capture(self) -> Any:
        return self.value.state_dict()

    def apply(self, captured: Any) -> Any:
        self.value.load_state_dict(captured)
        return self.value


class ModelHandler(_StateDictHandler):
    def sync(self, broadcast_object: Callable[[Any], Any]) -> Any:
        broadcast_parameters(self.value.state_dict(), root_rank=0)
        return self.value


class OptimizerHandler(_StateDictHandler):
    def sync(self, broadcast_object: Callable[[Any], Any]) -> Any:
        broadcast_optimizer_state(self.value, root_rank=0)
        return self.value


class ZeroHandler(Handler):
    """No rank holds a ZeroRedundancyOptimizer's whole state. A commit gathers it to
    rank 0, which keeps it (the copy persisted, and loaded at any world size); the
    other ranks commit nothing of it. A restore only puts the commit aside: loading is
    collective (each rank keeps its share) and restore may run on rank 0 alone
    (resuming from HVDLITE_ELASTIC_DIR), so ``sync`` loads rank 0's copy everywhere."""

    def __init__(self, value: ZeroRedundancyOptimizer) -> None:
        if value.process_set.process_set_id != global_process_set.process_set_id:
            raise UsageError(
                f"rank {rank()}: TorchState commits a ZeroRedundancyOptimizer over every "
                "rank only (its state is gathered to rank 0 and broadcast from there); "
                f"this one shards over process set {value.process_set.process_set_id}")
        super().__init__(value)
        self._restored: Optional[dict] = None     # rank 0's commit, until sync loads it

    def capture(self) -> Any:
        self.value.consolidate_state_dict(to=0)
        return self.value.state_dict() if rank() == 0 else None

    def apply(self, captured: Any) -> Any:
        self._restored = captured
        return self.value

    def sync(self, broadcast_object: Callable[[Any], Any]) -> Any:
        restored = broadcast_object(self._restored is not None)
        if restored:
            whole = self._restored
        else:
            whole = self.capture()         # collective: the live state, on rank 0
        self._restored = None
        self.value.load_state_dict(broadcast_object(whole))
        return self.value


class SamplerHandler(_StateDictHandler):
    def sync(self, broadcast_object: Callable[[Any], Any]) -> Any:
        return self.apply(broadcast_object(self.value.state_dict()))


# (type, handler) pairs, first match wins; append to support more types.
HANDLERS: list[tuple[type, type[Handler]]] = [
    (torch.nn.Module, ModelHandler),
    (ZeroRedundancyOptimizer, ZeroHandler),
    (torch.optim.Optimizer, OptimizerHandler),
    (ElasticSampler, SamplerHandler),
]


class TorchState(ObjectState):
    """Horovod's ``hvd.elastic.TorchState(model=None, optimizer=None, **kwargs)``."""

    def __init__(self, model: Optional[torch.nn.Module] = None,
                 optimizer: Optional[torch.optim.Optimizer] = None, **kwargs: Any) -> None:
        kwargs.update(model=model, optimizer=optimizer)
        handlers = {}
        for name in list(kwargs):
            handler = _handler_for(kwargs[name])
            if handler is not None:
                handlers[name] = handler
                del kwargs[name]
        super().__init__(bcast_object=broadcast_object, get_rank=rank, handlers=handlers,
                         **kwargs)

    def reset(self) -> None:
        for handler in self._handlers.values():
            if isinstance(handler, SamplerHandler):
                handler.value.reset()     # re-shard over the world as it is now


def _handler_for(value: Any) -> Optional[Handler]:
    for kind, handler in HANDLERS:
        if isinstance(value, kind):
            return handler(value)
    return None
