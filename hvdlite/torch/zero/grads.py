"""A ZeroRedundancyOptimizer's gradients in one flat buffer per space of its layout.

Each parameter's ``.grad`` becomes a view of its space's buffer: a hook moves a new
gradient there as soon as backward has made it, and the one autograd made is freed at
once, so gradients take the memory of one model, as DistributedOptimizer's buckets do.
Autograd then accumulates in place. The reductions read the buffers, chunk by chunk.
"""
from __future__ import annotations

import functools
import weakref
from typing import TYPE_CHECKING, Any

import torch

from hvdlite.torch import hooks

if TYPE_CHECKING:
    from hvdlite.torch.zero.optimizer import ZeroRedundancyOptimizer


class FlatGradients:
    """The flat buffers of one layout (``flat``, by space index), each parameter's view
    of its buffer (``views``, by position), and the hooks that fill them."""

    def __init__(self, opt: "ZeroRedundancyOptimizer") -> None:
        self._params = opt._params
        self.views: list[Any] = [None] * len(self._params)
        self.flat: list[torch.Tensor] = []
        for space in opt._spaces:
            flat = torch.zeros(space.total, dtype=space.dtype, device=space.device)
            self.flat.append(flat)
            for position, offset, numel in zip(space.positions, space.offsets, space.numels):
                self.views[position] = flat[offset:offset + numel].view_as(
                    self._params[position])
        self._hooks = [hooks.hook(param, opt,
                                  functools.partial(_arrived, weakref.ref(self), position))
                       for position, param in enumerate(self._params) if param.requires_grad]
        hooks.remove_when_freed(opt, self._hooks)

    def remove(self) -> None:
        """The hooks removed: a new layout has its own."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def into_view(self, position: int) -> None:
        """The parameter's ``.grad`` copied into its view, which it becomes, unless it is
        the view already. None: the view holds zeros for the reduction, and ``.grad``
        stays None (a frozen layer must not look as if it had a gradient at the next
        step). Sparse: left as it is, for ``step()`` to refuse on every rank."""
        param = self._params[position]
        view, grad = self.views[position], param.grad
        if grad is view or (grad is not None and grad.is_sparse):
            return
        with torch.no_grad():
            if grad is None:
                view.zero_()
                return
            view.copy_(grad)
        param.grad = view


def _arrived(grads_ref: "weakref.ref[FlatGradients]", position: int,
             optimizer: "ZeroRedundancyOptimizer", param: torch.Tensor) -> None:
    """A parameter's gradient made by backward: into its view, and the optimizer told.
    Only while this layout is the optimizer's (a new one has hooks of its own)."""
    grads = grads_ref()
    if (grads is not None and optimizer._grads is grads
            and optimizer._params[position] is param):
        optimizer._reduced = None      # a new gradient: reduce again at step()
        grads.into_view(position)
        optimizer._passes.arrived(position)
