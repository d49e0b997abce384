"""DistributedOptimizer: average gradients across ranks while backward runs.

The gradients live in the reducer's flat buckets (``hvdlite.reducer``), laid out
from the parameter list DDP's way and agreed with the peers when the first
gradient arrives: from then on every parameter's ``.grad`` is a view of its
bucket. A hook on each parameter fires when its gradient has been accumulated;
once every gradient of a bucket has seen ``backward_passes_per_step`` passes, the
bucket is allreduced in place by one request, so communication overlaps the rest
of the backward pass. ``step()`` waits for all of them, then runs the wrapped
optimizer.

``zero_grad(set_to_none=False)`` zeroes the buckets and keeps the views, so the
next backward adds straight into them: no copy at all. ``zero_grad()`` (torch's
default) leaves ``.grad`` None as torch does; autograd then makes a new tensor
for each gradient, which the hook copies into its bucket, pointing ``.grad`` at
the view again: one copy per gradient, as DDP's ``gradient_as_bucket_view`` pays
after the same call. Sparse gradients leave their bucket for the allgather path.
The hooks and ``synchronize()`` are in reduction.py; GradScaler's side in grad_scaling.py.

Each parameter of the optimizer's groups that requires a gradient has a bucket; a
change of ``requires_grad`` (unfreezing a backbone), seen at a step's first gradient,
lays them out again, agreed as the first layout. A gradient no rank had leaves
``.grad`` as it was (None), so the optimizer skips it as one process would.

It wraps the user's optimizer by composition inside one subclass of
``torch.optim.Optimizer`` (so LR schedulers accept it): ``param_groups``,
``state`` and ``defaults`` are the wrapped optimizer's own objects, so its
state survives wrapping and ``state_dict()`` round-trips unchanged.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Iterable, Iterator, Optional

import torch

import hvdlite as _hvd
from hvdlite.api.compression import Compression, Compressor
from hvdlite.api.process_set import ProcessSet
from hvdlite.diagnostics import autotune as _autotune, report as _report
from hvdlite.errors import HvdliteError, UsageError
from hvdlite.reducer.buckets import Reducer
from hvdlite.reducer.settings import Groups, Settings
from hvdlite.torch import hooks
from hvdlite.torch.grad_scaling import GradScalerSupport
from hvdlite.torch.reduction import GradientReduction


class DistributedOptimizer(GradientReduction, GradScalerSupport, torch.optim.Optimizer):
    """Horovod's ``hvd.DistributedOptimizer(optimizer, named_parameters=...)``: the
    gradients are averaged across ranks while backward runs, then ``optimizer`` steps.

    A hook on each parameter starts its gradient's reduction as soon as the gradient is
    accumulated; ``step()`` waits for them all, then steps the wrapped optimizer. From
    the first step the gradients are views into flat buckets (``HVDLITE_BUCKET_BYTES``),
    laid out in reverse registration order as DDP's.
    ``optimizer`` is wrapped by composition: ``param_groups`` and ``state`` are its own
    objects, and LR schedulers accept the wrapper.

    Args:
        optimizer: the ``torch.optim.Optimizer`` to wrap.
        named_parameters: the model's ``named_parameters()``; the names label each
            gradient's collective, the same on every rank. Duplicate names or a list
            that misses some of the optimizer's parameters raise ``UsageError`` (a
            ``ValueError``). Without it, parameters are numbered.
        compression: ``Compression.none``, ``Compression.fp16`` or
            ``Compression.bf16``: the floating gradients' type on the wire.
        backward_passes_per_step: backward passes accumulated locally before one
            reduction and one step.
        op: ``hvd.Average`` (the default), ``hvd.Sum``, or ``hvd.Adasum`` (``step()``
            then steps locally and Adasum-reduces each parameter's change).
        gradient_predivide_factor: with Average, divide by this before the sum and by
            ``size / factor`` after it (Horovod's meaning).
        num_groups: Horovod's older spelling of ``groups=n`` (its position too), used
            where ``groups`` is not given; 0, the default, asks for no groups.
        groups: a number of groups of consecutive parameters, or lists of parameters;
            each group is reduced together (one bucket of its own).
        sparse_as_dense: reduce sparse gradients (``nn.Embedding(sparse=True)``) as
            dense tensors instead of allgathering their indices and values.
        process_set: reduce over this ``ProcessSet`` only (default: every rank); ranks
            outside it keep their own gradients.
    """

    # op -> the subclass that op needs. op=Adasum reduces parameter deltas, not
    # gradients: a different optimizer (Horovod's factory returns a different class
    # too), which registers itself here (torch/adasum_optimizer.py).
    VARIANTS: dict[int, type["DistributedOptimizer"]] = {}

    def __new__(cls, *args: Any, **kwargs: Any) -> "DistributedOptimizer":
        op = kwargs.get("op", args[4] if len(args) > 4 else _hvd.Average)  # the 5th argument
        if cls is DistributedOptimizer:
            cls = DistributedOptimizer.VARIANTS.get(op, cls)
        return super().__new__(cls)

    def __init__(self, optimizer: torch.optim.Optimizer,
                 named_parameters: Optional[Iterable[tuple[str, torch.Tensor]]] = None,
                 compression: type[Compressor] = Compression.none,
                 backward_passes_per_step: int = 1, op: int = _hvd.Average,
                 gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                 groups: Groups = None, sparse_as_dense: bool = False,
                 process_set: Optional[ProcessSet] = None) -> None:
        # Deliberately no Optimizer.__init__: the wrapped optimizer owns the parameter
        # groups and state; attributes we lack are looked up on it (__getattr__).
        if isinstance(optimizer, DistributedOptimizer):
            raise UsageError("this optimizer is already a DistributedOptimizer")
        self.__dict__["_optimizer"] = optimizer
        self._settings = Settings("DistributedOptimizer", compression, op,
                                  gradient_predivide_factor, backward_passes_per_step,
                                  groups if groups is not None else (num_groups or None),
                                  process_set)
        self._sparse_as_dense = sparse_as_dense
        self._names = _parameter_names(optimizer, named_parameters)     # by id
        self._params = [p for g in optimizer.param_groups for p in g["params"]]
        self._position = {id(p): i for i, p in enumerate(self._params)}
        self._requires_grad = self._requires_grad_now()   # what the layout was made for
        self._layout_checked = False   # this step compared requires_grad with the layout
        self._absent: list[int] = []   # positions without a gradient here this step
        self._reducer: Optional[Reducer] = None        # made when the first gradient arrives
        self._steps = 0                                # optimizer steps taken (Reducer.steps)
        self._unagreed: Optional[HvdliteError] = None  # why it could not be: raised by step()
        self._sparse: set[int] = set()                 # positions whose gradients are sparse
        self._sparse_pending: dict[int, tuple[torch.Tensor, Any]] = {}
        self._densified: list[torch.Tensor] = []   # sparse_as_dense: made sparse again after
        self._synchronized = False
        self._synchronized_for_scaler = False   # by GradScaler.step (grad_scaling.py)
        self._should_synchronize = True
        self._warned_double_sync = False
        # A rank outside the process set keeps its own gradients, as Horovod's: no
        # hooks, nothing to wait for (the set's members reduce among themselves).
        self._outside = self._settings.outside()
        self._hook_handles: dict[int, Any] = {}        # by id: a hook on each trainable one
        hooks.claim(self._params, self)     # (a model wrapped again: the newest reduces)
        hooks.remove_when_freed(self, self._hook_handles)
        self._hook_trainable()
        if not self._outside:     # HVDLITE_AUTOTUNE may try other bucket sizes
            _autotune.follow("bucket_bytes", self._bucket_bytes_changed)

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

    @property
    def _parameter_names(self) -> dict[torch.Tensor, str]:
        """{parameter: name} as Horovod's optimizer has it (names are unique per rank
        and the same on every rank)."""
        return {param: self._names[id(param)] for param in self._params}

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        return self._optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        self._optimizer.load_state_dict(state_dict)

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
        if self._should_synchronize and self._synchronized and not self._synchronized_for_scaler:
            self._warn_step_after_synchronize()
        waiting = self._sparse_pending or (self._reducer is not None and self._reducer.pending)
        if self._should_synchronize and not (self._synchronized and not waiting):
            self.synchronize()
        self._synchronized = self._synchronized_for_scaler = False
        with self._scaler_attributes_forwarded():
            loss = self._optimizer.step(closure)
        self._steps += 1
        if self._reducer is not None:
            self._reducer.steps = self._steps
        recorder = _report.recorder()
        if recorder is not None:
            recorder.step_done()
        return loss

    def _warn_step_after_synchronize(self) -> None:
        # Horovod warns here too: the gradients are already reduced (we never
        # reduce them twice), but the script means skip_synchronize().
        if self._warned_double_sync:
            return
        self._warned_double_sync = True
        warnings.warn(
            # Horovod's wording first: scripts and Horovod's own tests match on it.
            "optimizer.step() called without optimizer.skip_synchronize() right after "
            "optimizer.synchronize(); the "
            "gradients are already averaged and are not reduced again. Wrap step() in "
            "`with optimizer.skip_synchronize():` to say so and silence this warning.",
            UserWarning, stacklevel=3)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As the wrapped optimizer's. With ``set_to_none=False``, bucketed gradients
        are zeroed in their buckets and stay views of them: the next backward adds
        straight into the buckets. With None (torch's default), each new gradient is
        copied into its bucket when its hook fires."""
        reducer = self._reducer
        pending = len(self._sparse_pending) + (reducer.pending if reducer is not None else 0)
        if pending:
            raise HvdliteError(
                f"rank {_hvd.rank()}: optimizer.zero_grad() was called while {pending} "
                "gradients are still being averaged across ranks "
                "(after backward(), before step()/synchronize()). Call zero_grad() before "
                "backward() or after step().")
        if reducer is None or set_to_none or reducer.alone:
            self._optimizer.zero_grad(set_to_none=set_to_none)
            return
        reducer.zero()
        for group in self._optimizer.param_groups:
            for param in group["params"]:
                if param.grad is None:                # as torch: a missing one stays so
                    continue
                position = self._position.get(id(param))
                if (position is not None and reducer.holds(position)
                        and position not in self._sparse):
                    param.grad = reducer.view(position)
                else:                                 # outside the buckets: sparse, frozen
                    param.grad.detach_().zero_()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """The new parameters get buckets too: the layout is made again (and agreed
        again, on every rank) when the next gradient arrives."""
        self._optimizer.add_param_group(param_group)
        added = [p for p in self._optimizer.param_groups[-1]["params"]
                 if id(p) not in self._position]
        for param in added:
            self._names.setdefault(id(param), f"noname.{len(self._names)}")
            self._position[id(param)] = len(self._params)
            self._params.append(param)
        if added:
            self._requires_grad, self._reducer = self._requires_grad_now(), None
            self._hook_trainable()


def _parameter_names(optimizer: torch.optim.Optimizer,
                     named_parameters: Optional[Iterable[tuple[str, torch.Tensor]]]) -> dict[int, str]:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if named_parameters is None:
        return {id(p): f"noname.{i}" for i, p in enumerate(params)}
    named = list(named_parameters)
    if any(not (isinstance(item, tuple) and len(item) == 2) for item in named):
        raise UsageError("named_parameters must be (name, parameter) pairs, as "
                         "model.named_parameters() yields")
    names = [name for name, _ in named]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise UsageError(f"named_parameters has duplicate names: {duplicates}; every "
                         "parameter needs its own name, the same on every rank")
    by_id = {id(p): name for name, p in named}
    missing = [i for i, p in enumerate(params) if id(p) not in by_id]
    if missing:
        raise UsageError(f"named_parameters was given but misses {len(missing)} of the "
                         f"optimizer's {len(params)} parameters (indices {missing[:5]}...); "
                         "pass model.named_parameters() for the model the optimizer trains")
    return by_id
