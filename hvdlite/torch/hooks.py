"""Gradient hooks that belong to the newest optimizer wrapping a parameter.

torch keeps a hook on a parameter for as long as the parameter lives, and the hook
keeps whatever it calls. Wrapping the same model again (a new phase of fine-tuning, a
new learning rate, an optimizer made again after unfreezing) would then leave the old
optimizer reducing every gradient beside the new one, and alive, buffers and lanes
included, for as long as the model. So each hook holds its optimizer weakly, calls it
only while that optimizer is the newest to claim the parameter, and is removed when
its optimizer is freed. ``DistributedOptimizer`` and ``ZeroRedundancyOptimizer`` both
claim their parameters here: one may replace the other.
"""
from __future__ import annotations

import functools
import weakref
from typing import Any, Callable, Iterable

import torch

# By id(parameter): (the parameter, the optimizer that claimed it last), both weakly.
_CLAIMS: dict[int, tuple["weakref.ref[torch.Tensor]", "weakref.ref[Any]"]] = {}


def claim(params: Iterable[torch.Tensor], owner: Any) -> None:
    """``owner``'s hooks reduce these parameters' gradients from now on; older ones'
    stand aside."""
    mine = weakref.ref(owner)
    for param in params:
        _CLAIMS[id(param)] = (weakref.ref(param, _forget(id(param))), mine)


def owns(param: torch.Tensor, owner: Any) -> bool:
    entry = _CLAIMS.get(id(param))
    return entry is not None and entry[0]() is param and entry[1]() is owner


def hook(param: torch.Tensor, owner: Any,
         on_grad: Callable[[Any, torch.Tensor], None]) -> Any:
    """A post-accumulate hook calling ``on_grad(owner, param)`` while ``owner`` lives
    and owns ``param``; its handle. Remove it with ``remove_when_freed``."""
    return param.register_post_accumulate_grad_hook(
        functools.partial(_call, weakref.ref(owner), on_grad))


def remove_when_freed(owner: Any, handles: Any) -> None:
    """Remove the hooks whose handles ``handles`` holds (a list, or a dict of them,
    filled now or later) once ``owner`` is freed."""
    weakref.finalize(owner, _remove, handles)


def _call(owner_ref: "weakref.ref[Any]", on_grad: Callable[[Any, torch.Tensor], None],
          param: torch.Tensor) -> None:
    owner = owner_ref()
    if owner is not None and owns(param, owner):
        on_grad(owner, param)


def _remove(handles: Any) -> None:
    for handle in list(handles.values() if isinstance(handles, dict) else handles):
        handle.remove()


def _forget(key: int) -> Callable[[Any], None]:
    def forget(dead: Any) -> None:
        entry = _CLAIMS.get(key)
        if entry is not None and entry[0] is dead:
            del _CLAIMS[key]
    return forget
