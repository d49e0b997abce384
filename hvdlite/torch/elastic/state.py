"""``TorchState``: a model, an optimizer, samplers and plain values, committed and
restored together. Models, optimizers and ElasticSamplers go through their
``state_dict`` (committed as the tensors' raw bytes: a restore is bitwise); any other
keyword argument (``epoch=0, batch=0``) is a plain attribute."""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from hvdlite.elastic.state import Handler, ObjectState
from hvdlite.torch.elastic.sampler import ElasticSampler
from hvdlite.torch.functions import (broadcast_object, broadcast_optimizer_state,
                                     broadcast_parameters)
from hvdlite.api.runtime import rank


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


class SamplerHandler(_StateDictHandler):
    def sync(self, broadcast_object: Callable[[Any], Any]) -> Any:
        return self.apply(broadcast_object(self.value.state_dict()))


# (type, handler) pairs, first match wins; append to support more types.
HANDLERS: list[tuple[type, type[Handler]]] = [
    (torch.nn.Module, ModelHandler),
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
