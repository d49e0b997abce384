"""DistributedOptimizer: average gradients across ranks while backward runs.

A hook on each parameter fires when its gradient has been accumulated; once a
parameter has seen ``backward_passes_per_step`` passes, its gradient is
allreduced asynchronously in place, so communication overlaps the rest of the
backward pass. ``step()`` waits for all of them, then runs the wrapped
optimizer.

It wraps the user's optimizer by composition inside one subclass of
``torch.optim.Optimizer`` (so LR schedulers accept it): ``param_groups``,
``state`` and ``defaults`` are the wrapped optimizer's own objects, so its
state survives wrapping and ``state_dict()`` round-trips unchanged.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence, Union

import torch

import hvdlite as _hvd
from hvdlite.api.process_set import ProcessSet
from hvdlite.errors import HvdliteError
from hvdlite.compression import Compression, Compressor
from hvdlite.torch.ops import allreduce_async_, synchronize

Groups = Union[None, int, Sequence[Sequence[torch.Tensor]]]


class DistributedOptimizer(torch.optim.Optimizer):
    """Horovod's ``hvd.DistributedOptimizer(optimizer, named_parameters=...)``."""

    def __init__(self, optimizer: torch.optim.Optimizer,
                 named_parameters: Optional[Iterable[tuple[str, torch.Tensor]]] = None,
                 compression: type[Compressor] = Compression.none,
                 backward_passes_per_step: int = 1, op: int = _hvd.Average,
                 gradient_predivide_factor: float = 1.0, groups: Groups = None,
                 sparse_as_dense: bool = False,
                 process_set: Optional[ProcessSet] = None) -> None:
        # Deliberately no Optimizer.__init__: the wrapped optimizer owns the parameter
        # groups and state; attributes we lack are looked up on it (__getattr__).
        if isinstance(optimizer, DistributedOptimizer):
            raise ValueError("this optimizer is already a DistributedOptimizer")
        if backward_passes_per_step < 1:
            raise ValueError("backward_passes_per_step must be >= 1")
        if op not in (_hvd.Average, _hvd.Sum):
            raise ValueError("DistributedOptimizer reduces gradients with op=Average or Sum")
        if gradient_predivide_factor != 1.0 and op != _hvd.Average:
            raise ValueError("gradient_predivide_factor needs op=Average")
        self.__dict__["_optimizer"] = optimizer
        self._compression = compression
        self._passes_per_step = backward_passes_per_step
        self._op, self._predivide = op, gradient_predivide_factor
        self._sparse_as_dense = sparse_as_dense
        self._process_set = process_set
        self._names = _parameter_names(optimizer, named_parameters)
        self._params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        self._group_of, self._group_members = _plan_groups(self._params, groups)
        self._pending: dict[int, tuple[int, torch.Tensor, torch.Tensor, Any]] = {}
        self._passes: dict[int, int] = {}
        self._ready_in_group: dict[int, int] = {}
        self._synchronized = False
        self._should_synchronize = True
        self._hook_handles = [p.register_post_accumulate_grad_hook(self._on_grad_ready)
                              for p in self._params]

    # -- the wrapped optimizer's data, shared rather than copied ------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self._optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self._optimizer.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self._optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self._optimizer.defaults

    def __getattr__(self, name: str) -> Any:
        optimizer = self.__dict__.get("_optimizer")
        if optimizer is None:
            raise AttributeError(name)
        return getattr(optimizer, name)

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self._optimizer!r})"

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        return self._optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        self._optimizer.load_state_dict(state_dict)

    # -- gradient reduction --------------------------------------------------------------------
    def _on_grad_ready(self, param: torch.Tensor) -> None:
        key = id(param)
        if key in self._pending:
            raise HvdliteError(
                f"rank {_hvd.rank()}: the gradient of '{self._names[key]}' was computed more "
                f"than backward_passes_per_step={self._passes_per_step} times before step(). "
                "Raise backward_passes_per_step to accumulate gradients locally, or call "
                "step() (or synchronize()) after each backward().")
        passes = self._passes.get(key, 0) + 1
        self._passes[key] = passes
        if passes < self._passes_per_step:
            return
        group = self._group_of.get(key)
        if group is None:
            self._submit(param)
            return
        self._ready_in_group[group] = self._ready_in_group.get(group, 0) + 1
        if self._ready_in_group[group] == len(self._group_members[group]):
            for member in self._group_members[group]:
                self._submit(member)

    def _submit(self, param: torch.Tensor) -> None:
        if param.grad is None:   # no gradient here this step; peers may have one
            param.grad = torch.zeros_like(param)
        elif param.grad.is_sparse:
            if not self._sparse_as_dense:
                raise HvdliteError(
                    f"'{self._names[id(param)]}' has a sparse gradient; pass "
                    "sparse_as_dense=True to DistributedOptimizer to reduce it densely.")
            param.grad = param.grad.to_dense()
        wire, context = self._compression.compress(param.grad)
        op, prescale, postscale = self._op, 1.0, 1.0
        if self._predivide != 1.0:   # Average as Sum, split the division around the sum
            size = self._process_set.size() if self._process_set else _hvd.size()
            op, prescale, postscale = _hvd.Sum, 1.0 / self._predivide, self._predivide / size
        handle = allreduce_async_(wire, name=f"allreduce.{self._names[id(param)]}", op=op,
                                  prescale_factor=prescale, postscale_factor=postscale,
                                  process_set=self._process_set)
        self._pending[id(param)] = (handle, param, wire, context)

    def synchronize(self) -> None:
        """Wait until every gradient is averaged. Parameters without a gradient on
        this rank take part with zeros, so ranks on other code paths still finish."""
        for param in self._params:
            if id(param) not in self._pending and not self._synchronized:
                self._submit(param)
        for handle, param, wire, context in self._pending.values():
            synchronize(handle)
            if wire is not param.grad:
                param.grad.copy_(self._compression.decompress(wire, context))
        self._pending.clear()
        self._passes.clear()
        self._ready_in_group.clear()
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """For ``synchronize(); clip_grad_norm_(...); with skip_synchronize(): step()``."""
        previous = self._should_synchronize
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = previous

    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:  # type: ignore[override]
        if self._should_synchronize and not (self._synchronized and not self._pending):
            self.synchronize()
        self._synchronized = False
        return self._optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._pending:
            raise HvdliteError(
                f"rank {_hvd.rank()}: optimizer.zero_grad() was called while "
                f"{len(self._pending)} gradients are still being averaged across ranks "
                "(after backward(), before step()/synchronize()). Call zero_grad() before "
                "backward() or after step().")
        self._optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self._optimizer.add_param_group(param_group)
        for param in self._optimizer.param_groups[-1]["params"]:
            if param.requires_grad and id(param) not in self._names:
                self._names[id(param)] = f"noname.{len(self._names)}"
                self._params.append(param)
                self._hook_handles.append(param.register_post_accumulate_grad_hook(
                    self._on_grad_ready))


def _parameter_names(optimizer: torch.optim.Optimizer,
                     named_parameters: Optional[Iterable[tuple[str, torch.Tensor]]]) -> dict[int, str]:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if named_parameters is None:
        return {id(p): f"noname.{i}" for i, p in enumerate(params)}
    named = list(named_parameters)
    if any(not (isinstance(item, tuple) and len(item) == 2) for item in named):
        raise ValueError("named_parameters must be (name, parameter) pairs, as "
                         "model.named_parameters() yields")
    names = [name for name, _ in named]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"named_parameters has duplicate names: {duplicates}; every "
                         "parameter needs its own name, the same on every rank")
    by_id = {id(p): name for name, p in named}
    missing = [i for i, p in enumerate(params) if id(p) not in by_id]
    if missing:
        raise ValueError(f"named_parameters was given but misses {len(missing)} of the "
                         f"optimizer's {len(params)} parameters (indices {missing[:5]}...); "
                         "pass model.named_parameters() for the model the optimizer trains")
    return by_id


def _plan_groups(params: list[torch.Tensor], groups: Groups) -> tuple[dict[int, int], list[list[torch.Tensor]]]:
    if groups is None:
        return {}, []
    if isinstance(groups, int):
        if groups < 1:
            raise ValueError("groups must be a positive number of groups or a list of lists")
        size = -(-len(params) // groups)
        members = [params[i:i + size] for i in range(0, len(params), size)]
    else:
        members = [list(group) for group in groups]
    group_of = {id(p): g for g, group in enumerate(members) for p in group}
    return group_of, members
