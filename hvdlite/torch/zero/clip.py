"""Gradient clipping for ZeroRedundancyOptimizer: the norm of the *averaged* gradients,
as ``torch.nn.utils.clip_grad_norm_`` computes it after DDP's backward or after
``DistributedOptimizer.synchronize()``.

Each rank holds the averaged gradients of its own elements only (after the
reduce-scatter), and every element has one owner; so the sum of ``|g|^p`` over all
elements is the sum over ranks of each rank's own part (one allreduce), and the
maximum for the inf-norm likewise. Every rank scales its part by the same factor,
torch's ``max_norm / (norm + 1e-6)`` clamped at 1.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from hvdlite.api import runtime
from hvdlite.errors import UsageError
from hvdlite.torch.mpi_ops import Max, Sum, allreduce

if TYPE_CHECKING:
    from hvdlite.torch.zero.optimizer import ZeroRedundancyOptimizer

_EPS = 1e-6      # torch's own, so that a norm below max_norm leaves gradients as they are


def clip(opt: "ZeroRedundancyOptimizer", max_norm: float, norm_type: float,
         error_if_nonfinite: bool) -> torch.Tensor:
    """Collective over the optimizer's set: the total norm (alike on every rank); this
    rank's averaged gradients scaled in place where it exceeds ``max_norm``."""
    norm_type = float(norm_type)
    if not norm_type > 0:
        raise UsageError(f"rank {runtime.rank()}: {opt._what}.clip_grad_norm_: norm_type must "
                         f"be positive (or inf), got {norm_type}")
    grads = [tensor.grad for _, _, tensor in opt._pieces if tensor.grad is not None]
    infinite = math.isinf(norm_type)
    if infinite:
        mine = max((g.abs().max().double().item() for g in grads if g.numel()), default=0.0)
    else:
        mine = sum(g.double().abs().pow(norm_type).sum().item() for g in grads)
    total = allreduce(torch.tensor([mine], dtype=torch.float64), op=Max if infinite else Sum,
                      name=f"{opt._what}.grad_norm", process_set=opt.process_set).item()
    norm = total if infinite else total ** (1.0 / norm_type)
    if error_if_nonfinite and not math.isfinite(norm):
        raise UsageError(
            f"rank {runtime.rank()}: {opt._what}.clip_grad_norm_: the averaged gradients' "
            f"norm of order {norm_type} is {norm} (on every rank); error_if_nonfinite=True")
    factor = min(max_norm / (norm + _EPS), 1.0)
    for grad in grads:
        grad.mul_(factor)
    return torch.tensor(norm, dtype=opt._spaces[0].dtype if opt._spaces else torch.float32)
