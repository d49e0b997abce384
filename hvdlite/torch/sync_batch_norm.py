"""SyncBatchNorm: batch statistics over every rank's shard.

In training, per-channel sum, sum of squares and count are allreduced (one
fused op), so each rank normalizes with the mean and variance of the global
batch; backward allreduces the two per-channel sums the input gradient needs.
Weight and bias gradients stay local sums, as in torch's SyncBatchNorm: the
DistributedOptimizer then averages them with every other gradient.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F

from hvdlite.api.process_set import ProcessSet
from hvdlite.torch.ops import allreduce_async, synchronize
import hvdlite as _hvd


def _sum_across(tensor: torch.Tensor, process_set: Optional[ProcessSet]) -> torch.Tensor:
    return synchronize(allreduce_async(tensor.contiguous(), op=_hvd.Sum, process_set=process_set))


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                running_mean: Optional[torch.Tensor], running_var: Optional[torch.Tensor],
                eps: float, momentum: float, process_set: Optional[ProcessSet]) -> torch.Tensor:
        dims = [d for d in range(x.dim()) if d != 1]
        channels = x.shape[1]
        wide = x.detach().double()
        local = torch.cat([wide.sum(dims), (wide * wide).sum(dims),
                           torch.full((1,), x.numel() / channels, dtype=torch.float64,
                                      device=x.device)])
        total = _sum_across(local, process_set)
        count = total[-1]
        mean = total[:channels] / count
        var = total[channels:2 * channels] / count - mean * mean
        if running_mean is not None:
            with torch.no_grad():
                running_mean.mul_(1 - momentum).add_(momentum * mean.to(running_mean.dtype))
                unbiased = var * count / max(count.item() - 1, 1)
                running_var.mul_(1 - momentum).add_(momentum * unbiased.to(running_var.dtype))
        invstd = torch.rsqrt(var + eps)
        shape = [1, channels] + [1] * (x.dim() - 2)
        xhat = (wide - mean.view(shape)) * invstd.view(shape)
        ctx.save_for_backward(xhat, weight, invstd)
        ctx.meta = (dims, shape, count, process_set, x.dtype)
        out = xhat * weight.double().view(shape) + bias.double().view(shape)
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        xhat, weight, invstd = ctx.saved_tensors
        dims, shape, count, process_set, dtype = ctx.meta
        dy = grad.double()
        sum_dy = dy.sum(dims)
        sum_dy_xhat = (dy * xhat).sum(dims)
        channels = sum_dy.numel()
        both = _sum_across(torch.cat([sum_dy, sum_dy_xhat]), process_set)
        mean_dy, mean_dy_xhat = both[:channels] / count, both[channels:] / count
        scale = (weight.double() * invstd).view(shape)
        dx = scale * (dy - mean_dy.view(shape) - xhat * mean_dy_xhat.view(shape))
        return (dx.to(dtype), sum_dy_xhat.to(weight.dtype), sum_dy.to(weight.dtype),
                None, None, None, None, None)


class SyncBatchNorm(torch.nn.modules.batchnorm._BatchNorm):
    """Drop-in for ``torch.nn.BatchNorm{1,2,3}d`` that normalizes over all ranks."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: Optional[float] = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 process_set: Optional[ProcessSet] = None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects at least 2D input (got {input.dim()}D)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not self.training and self.track_running_stats:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight,
                                self.bias, False, 0.0, self.eps)
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
        momentum = self.momentum if self.momentum is not None else (
            1.0 / float(self.num_batches_tracked))
        weight = self.weight if self.affine else torch.ones(self.num_features,
                                                                  device=input.device)
        bias = self.bias if self.affine else torch.zeros(self.num_features,
                                                                device=input.device)
        running = self.track_running_stats and self.training
        return _SyncBatchNormFunction.apply(
            input, weight, bias, self.running_mean if running else None,
            self.running_var if running else None, self.eps, momentum, self.process_set)

    @classmethod
    def convert_sync_batchnorm(cls, module: torch.nn.Module,
                               process_set: Optional[ProcessSet] = None) -> torch.nn.Module:
        """Replace every BatchNorm layer of ``module`` by a SyncBatchNorm, keeping state."""
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and not isinstance(module, cls):
            converted = cls(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats, process_set)
            reference = next(iter(module.parameters()), module.running_mean)
            if reference is not None:   # keep the layer's dtype and device
                converted = converted.to(device=reference.device, dtype=reference.dtype)
            converted.load_state_dict(module.state_dict())
            return converted
        for name, child in module.named_children():
            module.add_module(name, cls.convert_sync_batchnorm(child, process_set))
        return module
