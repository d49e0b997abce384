"""``DistributedOptimizer(op=hvd.Adasum)``: Adasum combines what each rank's
optimizer would do, not the raw gradients (Horovod's _DistributedAdasumOptimizer).

Each step: remember the parameters, run the wrapped optimizer locally on this
rank's gradients, take delta = new - old per parameter, Adasum-allreduce the
deltas (one reduction per tensor, so per-layer coefficients), and set
parameter = old + reduced delta. Because the local step happens first,
momentum and adaptive learning rates see local gradients, as in Horovod.

Unlike Horovod, the local step and the reduction run in ``step()`` rather
than per parameter in the gradient hooks: simpler, the same result, without
overlapping communication with the backward pass.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import torch

import hvdlite as _hvd
from hvdlite.api.compression import Compression, Compressor
from hvdlite.api.process_set import ProcessSet
from hvdlite.diagnostics import report as _report
from hvdlite.errors import UsageError
from hvdlite.torch.ops import grouped_allreduce
from hvdlite.torch.optimizer import DistributedOptimizer, _parameter_names


class AdasumDistributedOptimizer(DistributedOptimizer):
    """What ``DistributedOptimizer(..., op=hvd.Adasum)`` builds (see the module doc)."""

    def __init__(self, optimizer: torch.optim.Optimizer,
                 named_parameters: Optional[Iterable[tuple[str, torch.Tensor]]] = None,
                 compression: type[Compressor] = Compression.none,
                 backward_passes_per_step: int = 1, op: int = _hvd.Adasum,
                 gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                 groups: Any = None, sparse_as_dense: bool = False,
                 process_set: Optional[ProcessSet] = None) -> None:
        if isinstance(optimizer, DistributedOptimizer):
            raise UsageError("this optimizer is already a DistributedOptimizer")
        if backward_passes_per_step < 1:
            raise UsageError("backward_passes_per_step must be >= 1")
        if gradient_predivide_factor != 1.0:
            raise UsageError("gradient_predivide_factor needs op=Average, not Adasum")
        # backward_passes_per_step needs no counting here: gradients accumulate
        # locally until the user calls step(), which is when deltas are reduced.
        self.__dict__["_optimizer"] = optimizer
        self._op, self._process_set = op, process_set
        self._compression = compression
        self._names = _parameter_names(optimizer, named_parameters)
        self._should_synchronize = True

    @property
    def _parameter_names(self) -> dict[torch.Tensor, str]:
        """{parameter: name}, as DistributedOptimizer's (parameters of groups added
        later are named "noname.N")."""
        return {p: self._names[id(p)] for group in self._optimizer.param_groups
                for p in group["params"]}

    def _trainable(self) -> list[torch.Tensor]:
        return [p for group in self._optimizer.param_groups for p in group["params"]
                if p.requires_grad]

    def synchronize(self) -> None:
        """Nothing to wait for: Adasum reduces parameter deltas inside ``step()``."""

    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:  # type: ignore[override]
        params = self._trainable()
        starts = [p.detach().clone() for p in params]
        loss = self._optimizer.step(closure)
        if not self._should_synchronize:     # skip_synchronize(): a purely local step
            return loss
        deltas = [p.detach() - start for p, start in zip(params, starts)]
        recorder = _report.recorder()     # HVDLITE_REPORT: time blocked, step boundary
        started = recorder.optimizer_wait_begin() if recorder is not None else 0.0
        try:
            if deltas:
                reduced = grouped_allreduce(
                    deltas, name="adasum_delta", compression=self._compression,
                    op=_hvd.Adasum, process_set=self._process_set)
                with torch.no_grad():
                    for param, start, delta in zip(params, starts, reduced):
                        param.copy_(start.add_(delta))
        finally:
            if recorder is not None:
                recorder.optimizer_wait_end(started)
        if recorder is not None:
            recorder.step_done()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self._optimizer.add_param_group(param_group)
        for param in self._optimizer.param_groups[-1]["params"]:
            self._names.setdefault(id(param), f"noname.{len(self._names)}")


DistributedOptimizer.VARIANTS[_hvd.Adasum] = AdasumDistributedOptimizer
