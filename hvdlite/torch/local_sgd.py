"""Local SGD: every rank steps on its own gradients, and the models are averaged every
few steps instead of the gradients every step (torch's ``PeriodicModelAverager`` and
``PostLocalSGDOptimizer``, on hvdlite's collectives).

``PeriodicModelAverager(period, warmup_steps)`` counts its calls: from call
``warmup_steps`` on, every ``period``-th call averages the parameters it is given across
the process set, in one grouped in-place allreduce (the engine fuses it into buckets).
``PostLocalSGDOptimizer(optimizer, averager)`` steps the wrapped optimizer and then asks
the averager; for the first ``warmup_steps`` steps it averages the gradients before
stepping, as ``DistributedOptimizer`` does, so that training starts as synchronous SGD
and every rank holds the same model when the local phase begins.

Which tensors are averaged is decided from the model alone, so every rank decides alike:
every parameter that requires a gradient, whether or not this rank's step produced one
(torch's averager skips those without a gradient, which ranks that took different
branches would not agree on). Optimizer state (momentum, Adam's moments) stays each
rank's own, as in torch.
"""
from __future__ import annotations

from typing import Any, Iterable, Optional

import torch

from hvdlite.api.process_set import ProcessSet, global_process_set
from hvdlite.api.submission import check_count
from hvdlite.errors import UsageError
from hvdlite.torch.mpi_ops import Average, Max, allreduce, grouped_allreduce_


def _tensors(params: Iterable[Any]) -> list[torch.Tensor]:
    """The tensors of ``params``: parameters or tensors, ``(name, parameter)`` pairs, or
    an optimizer's parameter groups; parameters that need no gradient are left out."""
    found: list[torch.Tensor] = []
    for item in params:
        if isinstance(item, dict):
            found.extend(_tensors(item["params"]))
        elif isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            found.extend(_tensors([item[1]]))
        elif isinstance(item, torch.Tensor):
            if not isinstance(item, torch.nn.Parameter) or item.requires_grad:
                found.append(item)
        else:
            raise UsageError(f"average_parameters takes parameters, (name, parameter) pairs "
                             f"or parameter groups, not {type(item).__name__}")
    return found


def _average_in_place(tensors: list[torch.Tensor], what: str, process_set: ProcessSet) -> None:
    if tensors:
        with torch.no_grad():
            grouped_allreduce_([t.data for t in tensors], op=Average, process_set=process_set,
                               name=f"local_sgd.{what}")


class PeriodicModelAverager:
    """torch's ``PeriodicModelAverager``: ``average_parameters(params)`` once per step;
    it averages them across ``process_set`` on every ``period``-th call from call
    ``warmup_steps`` on (the first of those included), and counts the call in ``step``."""

    def __init__(self, period: int, warmup_steps: int = 0,
                 process_set: ProcessSet = global_process_set) -> None:
        self.period = check_count(period, "period", 1)
        self.warmup_steps = check_count(warmup_steps, "warmup_steps", 0)
        self.process_set = process_set
        self.step = 0

    def averages_now(self) -> bool:
        """Whether the next ``average_parameters`` call averages."""
        return self.step >= self.warmup_steps and \
            (self.step - self.warmup_steps) % self.period == 0

    def average_parameters(self, params: Iterable[Any]) -> None:
        if self.averages_now():
            _average_in_place(_tensors(params), "parameters", self.process_set)
        self.step += 1


class PostLocalSGDOptimizer(torch.optim.Optimizer):
    """torch's ``PostLocalSGDOptimizer(optim, averager)``: ``step()`` steps ``optim`` on
    this rank's gradients, then hands its parameters to ``averager``. While the
    averager is in its warm-up the gradients are averaged first (a parameter no rank
    has a gradient for keeps None; one some ranks have counts as zeros on the others).
    ``param_groups`` and ``state`` are ``optim``'s own objects; ``state_dict()`` adds the
    averager's step count under "step", which ``load_state_dict`` restores."""

    def __init__(self, optim: torch.optim.Optimizer, averager: PeriodicModelAverager) -> None:
        if not isinstance(optim, torch.optim.Optimizer):
            raise UsageError(f"PostLocalSGDOptimizer wraps a torch.optim.Optimizer, not "
                             f"{type(optim).__name__}")
        if not isinstance(averager, PeriodicModelAverager):
            raise UsageError(f"PostLocalSGDOptimizer takes a PeriodicModelAverager, not "
                             f"{type(averager).__name__}")
        self.optim, self.averager = optim, averager
        # The wrapped optimizer's own objects, as DistributedOptimizer keeps them.
        self.param_groups, self.state, self.defaults = optim.param_groups, optim.state, \
            optim.defaults

    def __repr__(self) -> str:
        return f"PostLocalSGDOptimizer({self.optim!r}, period={self.averager.period})"

    def step(self, closure: Optional[Any] = None) -> Any:
        """``closure`` (recomputing the loss and its gradients) runs first, here, so that
        the gradients the warm-up averages are the ones ``optim`` steps on."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.averager.step < self.averager.warmup_steps:
            self._average_gradients()
        self.optim.step()
        self.averager.average_parameters(self.param_groups)
        return loss

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optim.add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        state = self.optim.state_dict()
        state["step"] = self.averager.step
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        if "step" not in state_dict:
            raise UsageError("this state dict has no 'step': it was not saved by a "
                             "PostLocalSGDOptimizer, whose averager's count it restores")
        self.averager.step = check_count(state_dict.pop("step"), "the state dict's step", 0)
        self.optim.load_state_dict(state_dict)
        self.param_groups, self.state = self.optim.param_groups, self.optim.state

    def _average_gradients(self) -> None:
        """As synchronous SGD: the gradients every rank has, averaged; a parameter that
        has a gradient somewhere gets one everywhere (zeros where it had none), so every
        rank steps the same parameters."""
        params = _tensors(self.param_groups)
        if not params:
            return
        had = torch.tensor([p.grad is not None for p in params], dtype=torch.uint8)
        anywhere = allreduce(had, op=Max, name="local_sgd.gradients_present",
                             process_set=self.averager.process_set)
        grads = []
        for param, used in zip(params, anywhere.tolist()):
            if used and param.grad is None:
                param.grad = torch.zeros_like(param)
            if used:
                grads.append(param.grad)
        _average_in_place(grads, "gradients", self.averager.process_set)
