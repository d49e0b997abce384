"""``torch.amp.GradScaler`` with ZeroRedundancyOptimizer, as torch's AMP recipe calls it
(``scaler.scale(loss).backward(); scaler.step(optimizer); scaler.update()``).

The scaler skips a step, and halves its scale, where it finds an inf or a nan in the
gradients: every rank must decide alike, from the averaged gradients, or a rank whose
batch overflowed skips alone and its scale parts from the others'. Here each rank
holds the averaged gradients of its own share only, so:

1. ``scaler.step`` first asks ``_step_supports_amp_scaling``: the optimizer reduces
   there (the reduce-scatter ``step()`` would run) and the ranks agree whether any
   share holds an inf or a nan. An element that is not finite on any rank is not
   finite in its average, so this is "any rank overflowed". They agree with one sum
   on a lane of the optimizer's own (hvdlite/engine/lane.py, opened at its first
   scaled step where lanes carry float32: no negotiation round; its check words carry
   the step, so a rank out of step is a MismatchError on every rank), else with one
   allreduce.
2. The answer is yes: the scaler then checks the gradients in ``.grad`` of the
   optimizer's parameters, each rank its own, and must find what the ranks agreed.
   Where they agreed on an overflow, one element of the first trainable parameter's
   ``.grad`` is set to nan on every rank (those gradients are spent: the shares hold
   what ``step()`` uses); where they did not, no rank's own gradients hold one.
   Every rank's ``found_inf``, and so its skip and its next scale, are then alike.
3. ``step()`` gets the scaler's ``grad_scale`` and ``found_inf``: it skips the step on
   every rank alike, or unscales each share as the scaler would (times the float32
   reciprocal of the scale) and steps.

``scaler.unscale_(optimizer)`` before ``scaler.step`` reads each rank's own gradients
before they are averaged: refused in ``step()``, on every rank alike.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from hvdlite.api import lane, runtime
from hvdlite.api.submission import synchronize
from hvdlite.errors import NotSupportedError
from hvdlite.torch.mpi_ops import Max, allreduce

if TYPE_CHECKING:
    from hvdlite.torch.zero.optimizer import ZeroRedundancyOptimizer


def agree_on_overflow(opt: "ZeroRedundancyOptimizer") -> None:
    """Collective, after this step's reduction: show the scaler's check on every rank
    whether any rank's share holds an inf or a nan."""
    mine = any(not bool(torch.isfinite(tensor.grad).all())
               for _, _, tensor in opt._pieces if tensor.grad is not None)
    if not _on_any_rank(opt, mine):
        return
    with torch.no_grad():
        for position, param in enumerate(opt._params):
            if param.requires_grad:
                view = opt._grads.views[position]
                if view.numel():
                    view.view(-1)[0] = float("nan")
                    param.grad = view
                    return


def _on_any_rank(opt: "ZeroRedundancyOptimizer", mine: bool) -> bool:
    """Whether ``mine`` is true on any rank of the optimizer's set. The lane is opened
    alike on every rank (HVDLITE_LANE is agreed at init)."""
    name = f"{opt._what}.overflow"
    if opt.__dict__.get("_overflow_lane") is None and lane.carries("float32", "cpu"):
        opt._overflow_lane = lane.Lane(name, [1 + lane.CHECK_WORDS], "float32",
                                       opt.process_set)
    vote = opt.__dict__.get("_overflow_lane")
    if vote is None or not vote.opened:
        return allreduce(torch.tensor([float(mine)]), op=Max, name=name,
                         process_set=opt.process_set).item() > 0
    buf = np.zeros(1 + lane.CHECK_WORDS, np.float32)
    buf[0] = float(mine)
    synchronize(vote.submit(buf, 0, 1.0, opt._steps, name, ()))
    return bool(buf[0] > 0)


def unscaled_or_skipped(opt: "ZeroRedundancyOptimizer") -> bool:
    """Inside ``step()`` under ``scaler.step``: True to skip it (an overflow agreed by
    every rank); else each share unscaled in place."""
    found_inf, grad_scale = opt.__dict__["found_inf"], opt.__dict__.get("grad_scale")
    if grad_scale is None:
        raise NotSupportedError(
            f"rank {runtime.rank()}: {opt._what}: scaler.unscale_(optimizer) before "
            "scaler.step() is not supported with ZeroRedundancyOptimizer: it reads each "
            "rank's own gradients, before they are averaged, and its verdict would differ "
            "between ranks. Call scaler.step(optimizer) straight after backward()")
    if found_inf.item() > 0:
        return True
    inverse = grad_scale.double().reciprocal().float()
    with torch.no_grad():
        for _, _, tensor in opt._pieces:
            if tensor.grad is not None:
                tensor.grad.mul_(inverse.to(tensor.grad.dtype))
    return False


def under_scaler(opt: Any) -> bool:
    """``step()`` is being called by a GradScaler, which set ``found_inf`` for it."""
    return "found_inf" in opt.__dict__
