"""How the DistributedOptimizer (hvdlite/torch/optimizer.py) averages gradients: the
reducer's buckets laid out from its parameters and agreed with the peers, a hook per
parameter that starts a bucket once its gradients are complete, and ``synchronize()``,
which starts what is left and waits for all of it.

A gradient no rank had leaves ``.grad`` as it was (None); one that some ranks had is
averaged with zeros from the others. A change of ``requires_grad`` between steps lays
the buckets out again, agreed as the first layout; one during a step is an error.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

import hvdlite as _hvd
from hvdlite.diagnostics import report as _report
from hvdlite.errors import HvdliteError, UsageError
from hvdlite.reducer.buckets import Reducer
from hvdlite.reducer.settings import Settings
from hvdlite.torch import hooks
from hvdlite.torch.adapter import TORCH
from hvdlite.torch.sparse import sparse_allreduce_async


class GradientReduction:
    """Mixed into the DistributedOptimizer, whose ``__init__`` sets these."""

    _settings: Settings
    _sparse_as_dense: bool
    _names: dict[int, str]
    _params: list[torch.Tensor]
    _position: dict[int, int]
    _requires_grad: tuple[bool, ...]
    _layout_checked: bool
    _absent: list[int]
    _reducer: Optional[Reducer]
    _steps: int
    _unagreed: Optional[HvdliteError]
    _sparse: set[int]
    _sparse_pending: dict[int, tuple[torch.Tensor, Any]]
    _densified: list[torch.Tensor]
    _synchronized: bool
    _synchronized_for_scaler: bool
    _outside: bool
    _hook_handles: dict[int, Any]

    def _agreed_reducer(self) -> Optional[Reducer]:
        """The reducer, made on first use and again after ``requires_grad`` changed: its
        layout comes from the parameters and which require a gradient, agreed with the
        peers in one exchange before any gradient is reduced. If the ranks' parameters
        differ, every rank's next step() raises the MismatchError, and the step after
        tries again (a caught error or an elastic retry mends the model first)."""
        if not self._layout_checked:
            self._layout_checked = True
            self._follow_requires_grad()
        if self._reducer is None and self._unagreed is None and self._params:
            specs = [(self._names[id(p)], tuple(p.shape), TORCH.dtype_name(p), TORCH.device(p))
                     for p in self._params]
            try:
                self._reducer = Reducer(TORCH, specs, self._settings,
                                        lambda p: self._position.get(id(p)),
                                        trainable=self._requires_grad)
            except HvdliteError as error:
                self._unagreed = error
            else:       # sparse gradients stay out of the new buckets, on every rank
                self._reducer.steps = self._steps
                for position in self._sparse:
                    if self._reducer.holds(position):
                        self._reducer.evict(position)
        return self._reducer

    def _requires_grad_now(self) -> tuple[bool, ...]:
        return tuple(p.requires_grad for p in self._params)

    def _follow_requires_grad(self) -> None:
        """Frozen or unfrozen since the layout was made: lay the buckets out again."""
        now = self._requires_grad_now()
        if now != self._requires_grad:
            self._requires_grad, self._reducer = now, None
            self._hook_trainable()

    def _hook_trainable(self) -> None:
        """A hook on each parameter requiring a gradient (torch refuses one elsewhere)."""
        if self._outside:
            return
        for param in self._params:
            if param.requires_grad and id(param) not in self._hook_handles:
                self._hook_handles[id(param)] = hooks.hook(param, self,
                                                           type(self)._on_grad_ready)

    def _bucket_bytes_changed(self, bucket_bytes: int) -> None:
        """Autotune changed HVDLITE_BUCKET_BYTES, on every rank at the same step boundary
        (nothing is in flight there): the layout is made again, and agreed again, when
        the next gradient arrives; a .grad still viewing an old bucket is copied in."""
        self._reducer = None

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if self._synchronized:      # a new step's gradients: the last was synchronized
            self._synchronized = self._synchronized_for_scaler = False   # and not stepped
        reducer = self._agreed_reducer()
        if reducer is None:
            return
        position = self._position[id(param)]
        if not reducer.holds(position):     # made trainable after this step's layout
            return                          # (step() says so: _unlaid)
        grad = param.grad
        if position in self._sparse or (grad is not None and grad.is_sparse
                                        and not self._sparse_as_dense):
            self._sparse.add(position)
            reducer.evict(position)
            if reducer.ready(position):
                self._start_sparse(param)
            return
        self._into_view(reducer, param, position)
        reducer.ready(position)

    def _into_view(self, reducer: Reducer, param: torch.Tensor, position: int) -> None:
        """Point ``.grad`` at its view of the bucket, copying in the gradient it holds
        (a new one after zero_grad(), one the user assigned; none: zeros)."""
        view = reducer.view(position)
        grad = param.grad
        if view is None or grad is view:       # a set of one rank has no buckets
            return
        if grad is None:
            view.zero_()
        elif grad.shape != view.shape or grad.dtype != view.dtype:
            reducer.fail(position, tuple(grad.shape), TORCH.dtype_name(grad))
        elif grad.is_sparse:                   # sparse_as_dense
            view.copy_(grad.to_dense())
            self._densified.append(param)
        else:
            view.copy_(grad)
        param.grad = view

    def _start_sparse(self, param: torch.Tensor) -> None:
        """Allgather a sparse gradient's indices and values (no compression: they are
        exact rows); a rank without one this step sends none."""
        grad = param.grad
        if grad is None or not grad.is_sparse:
            grad = (torch.zeros_like(param) if grad is None else grad).to_sparse(1)
        name = self._names[id(param)]
        handle = sparse_allreduce_async(grad, f"sparse_allreduce.{name}", self._settings.op,
                                        self._settings.process_set)
        self._sparse_pending[id(param)] = (param, handle)

    def synchronize(self) -> None:
        """Wait until every gradient is averaged. Parameters without a gradient on
        this rank take part with zeros, so ranks on other code paths still finish;
        one that no rank had a gradient for keeps ``.grad`` None."""
        recorder = _report.recorder()     # HVDLITE_REPORT: time blocked here
        started = recorder.optimizer_wait_begin() if recorder is not None else 0.0
        try:
            self._synchronize()
        finally:
            if recorder is not None:
                recorder.optimizer_wait_end(started)

    def _synchronize(self) -> None:
        """Every started reduction is waited for even when one fails, and the first
        error raised after: nothing is left pending (see Reducer.wait)."""
        if self._outside:
            self._synchronized = True
            return
        try:
            errors = self._reduce_all()
        finally:
            self._layout_checked, self._absent = False, []
        if errors:
            raise errors[0]
        self._synchronized = True

    def _reduce_all(self) -> list[HvdliteError]:
        reducer = self._agreed_reducer()
        errors = [] if self._unagreed is None else [self._unagreed]
        self._unagreed = None
        if reducer is not None and not self._synchronized:
            try:
                self._start_the_rest(reducer)
            except HvdliteError as error:
                errors.append(error)
        if reducer is not None:
            errors.extend(reducer.wait())
            for position in self._absent:       # used on another rank: averaged with zeros
                if position not in reducer.unused and reducer.view(position) is not None:
                    self._params[position].grad = reducer.view(position)
            errors.extend(self._unlaid(reducer))
        for param, handle in self._sparse_pending.values():
            try:
                reduced = handle.result()
            except HvdliteError as error:
                errors.append(error)
                continue
            # No row on any rank: the parameter was not used anywhere (a rank without
            # a gradient sends none), so .grad is None, as in one process, and the
            # optimizer skips it (SparseAdam would count a step for an empty one).
            # Every rank holds the same result, so every rank decides alike.
            param.grad = reduced if reduced._nnz() else None
        self._sparse_pending.clear()
        for param in self._densified:       # reduced dense; the optimizer (SparseAdam)
            param.grad = param.grad.to_sparse()   # expects the gradient it produced
        self._densified.clear()
        return errors

    def _unlaid(self, reducer: Reducer) -> list[HvdliteError]:
        """A parameter that began to require a gradient after this step's first one and
        has one: it is not in the buckets, so it was not averaged (the next step lays it
        out). Looked at once a step."""
        now = self._requires_grad_now()
        if now == self._requires_grad:
            return []
        unlaid = [self._names[id(p)] for i, (p, wants) in enumerate(zip(self._params, now))
                  if wants and p.grad is not None and not reducer.holds(i)]
        return [UsageError(
            f"rank {_hvd.rank()}: {unlaid} began to require a gradient during a step (after "
            "its first gradient), so their gradients were not averaged. Change "
            "requires_grad between steps: after step(), before backward().")] if unlaid else []

    def _start_the_rest(self, reducer: Reducer) -> None:
        """The gradients this step has not completed (none on this rank, or fewer
        passes) take part as they are, a missing one as zeros, so every rank reduces
        every bucket."""
        for position in reducer.unready():
            param = self._params[position]
            if position in self._sparse:
                self._start_sparse(param)
            elif param.grad is None:
                reducer.absent(position)
                self._absent.append(position)
            else:
                self._into_view(reducer, param, position)
        reducer.start_the_rest()
