"""Gradient buckets for the torch DistributedOptimizer, DDP's way.

After the first step, the parameters are laid out in flat buckets of about
HVDLITE_BUCKET_BYTES (25 MiB; the first 1 MiB, so communication starts while
most of backward is still to come), in the order backward produced their
gradients in step 1 (rank 0's order, so every rank agrees), parameters that
had no gradient last, in reverse registration order. Each bucket holds one
dtype on one device; a ``groups=`` group is a bucket of its own. From then on
every parameter's ``.grad`` is a view into its bucket: autograd accumulates
straight into the bucket, and when a bucket's last gradient is ready one
in-place allreduce of the whole bucket goes to the engine (a request prepared
once, see ``hvdlite.api.prepared``). There is no packing copy and no unpacking
copy: the averaged result is already in every ``.grad``.

``zero_grad(set_to_none=False)`` zeroes the buckets and keeps the views, so the
next backward adds straight into them: no copy at all. ``zero_grad()`` (torch's
default, ``set_to_none=True``) leaves ``.grad`` None as torch does; autograd then
makes a new tensor for each gradient, which the hook copies into its bucket,
pointing ``.grad`` at the view again: one copy per gradient, as DDP's
``gradient_as_bucket_view`` pays after the same call. Any other ``.grad`` that is
not its view when its hook fires (assigned by the user) is copied in the same way.
"""
from __future__ import annotations

from typing import Any, Callable, NoReturn, Optional, Sequence

import torch

from hvdlite.api import runtime
from hvdlite.api.compression import Compression, Compressor
from hvdlite.api.gradients import bucket_plan, scaled_op
from hvdlite.api.prepared import PreparedAllreduce
from hvdlite.api.process_set import ProcessSet
from hvdlite.api.submission import Call
from hvdlite.core.requests import Kind
from hvdlite.errors import HvdliteError, UsageError
from hvdlite.torch.adapter import TORCH
from hvdlite.torch.ops import OPS

_FAILED = object()               # a bucket's handle after this rank failed it (see _deviated)


def layout(params: Sequence[torch.Tensor], order: Sequence[int], cap: int,
           groups: Sequence[Sequence[int]]) -> list[list[int]]:
    """Parameter indices per bucket: each ``groups`` group its own buckets (one per
    dtype and device), then the rest in ``order`` (see ``bucket_plan``)."""
    nbytes = [p.numel() * p.element_size() for p in params]
    kinds = [(p.dtype, p.device) for p in params]
    grouped = {i for group in groups for i in group}
    buckets = [b for group in groups for b in bucket_plan(nbytes, kinds, list(group), 0)]
    buckets += bucket_plan(nbytes, kinds, [i for i in order if i not in grouped], cap)
    return [b for b in buckets if b]


class Bucket:
    """One flat buffer, the parameters viewing into it, and its reduction."""

    def __init__(self, index: int, params: list[torch.Tensor], names: list[str],
                 shapes: list[torch.Size]) -> None:
        """``shapes``: the parameters' shapes when the layout was agreed (a parameter
        replaced since then no longer fits, and ready() says so)."""
        self.index, self.params, self.names = index, params, names
        # Named by its parameters, which are named the same on every rank and differ
        # between two optimizers (a GAN's two): the engine caches it under this name.
        self.name = f"DistributedOptimizer.bucket.{index}.{names[0]}..{names[-1]}"
        first = params[0]
        total = sum(shape.numel() for shape in shapes)
        self.flat = torch.zeros(total, dtype=first.dtype, device=first.device)
        self.views: list[torch.Tensor] = []
        offset = 0
        for shape in shapes:
            self.views.append(self.flat[offset:offset + shape.numel()].view(shape))
            offset += shape.numel()
        self.waiting = len(params)     # gradients not ready yet this step
        self.handle: Any = None
        self.wire: Any = None          # the compressed copy on the wire, and its context
        self.prepared: Optional[PreparedAllreduce] = None

    def adopt(self) -> None:
        """Copy each parameter's current gradient into the bucket and point ``.grad``
        at its view (once, when the buckets are made)."""
        for p, view in zip(self.params, self.views):
            if p.grad is None:
                p.grad = view
            elif p.grad.shape == view.shape and p.grad.dtype == view.dtype:
                view.copy_(p.grad)
                p.grad = view
            # (else the parameter changed since step 1: ready() fails it, naming it)


class Buckets:
    """Every bucket of one optimizer, and the per-step bookkeeping."""

    def __init__(self, buckets: list[Bucket], passes: int, compression: type[Compressor],
                 op: int, predivide: float, process_set: Optional[ProcessSet]) -> None:
        self.buckets = buckets
        self.of: dict[int, tuple[Bucket, int]] = {
            id(p): (b, i) for b in buckets for i, p in enumerate(b.params)}
        self.passes_per_step = passes
        self._passes: dict[int, int] = {}
        self._compression = compression
        self._op, self._prescale, self._postscale = scaled_op(op, predivide, process_set)
        self._process_set = process_set
        self.started: list[Bucket] = []

    def contains(self, param: torch.Tensor) -> bool:
        return id(param) in self.of

    def ready(self, param: torch.Tensor) -> None:
        """A gradient is accumulated: count the pass, start the bucket when full."""
        bucket, slot = self.of[id(param)]
        view = bucket.views[slot]
        if param.grad is not view:
            grad = param.grad
            if grad is not None and (grad.shape != view.shape or grad.dtype != view.dtype):
                self._deviated(bucket, slot, grad)
            _restore_view(param, view)
        passes = self._passes.get(id(param), 0) + 1
        if passes > self.passes_per_step or bucket.handle is not None:
            raise HvdliteError(
                f"the gradient of '{bucket.names[slot]}' was computed more than "
                f"backward_passes_per_step={self.passes_per_step} times before step(). "
                "Raise backward_passes_per_step to accumulate gradients locally, or call "
                "step() (or synchronize()) after each backward().")
        self._passes[id(param)] = passes
        if passes == self.passes_per_step:
            bucket.waiting -= 1
            if bucket.waiting == 0:
                self._start(bucket)

    def _deviated(self, bucket: Bucket, slot: int, grad: torch.Tensor) -> NoReturn:
        """A gradient no longer fits the layout agreed at step 1: fail this rank, and
        the bucket on every rank through negotiation (an error marker under its
        name), instead of a hang or a sum of mismatched memory."""
        view = bucket.views[slot]
        error = UsageError(
            f"rank {runtime.rank()}: the gradient of '{bucket.names[slot]}' is "
            f"{tuple(grad.shape)} {grad.dtype}, but its bucket was laid out at the first "
            f"step for {tuple(view.shape)} {view.dtype}. Make the DistributedOptimizer after "
            "changing the model's parameters (on every rank), or set HVDLITE_BUCKET_BYTES=0")
        Call(Kind.ALLREDUCE, bucket.name, self._process_set).mark(error)
        bucket.handle = _FAILED
        raise error

    def _start(self, bucket: Bucket) -> None:
        if self._compression is Compression.none:
            if bucket.prepared is None:
                bucket.prepared = PreparedAllreduce(
                    TORCH, bucket.flat, bucket.name,
                    self._op, self._prescale, self._postscale, self._process_set)
            bucket.handle = bucket.prepared.submit()
        else:
            wire, context = self._compression.compress(bucket.flat)
            bucket.wire = (wire, context)
            bucket.handle = OPS["allreduce_async_"](
                wire, name=bucket.name, op=self._op,
                prescale_factor=self._prescale, postscale_factor=self._postscale,
                process_set=self._process_set)
        self.started.append(bucket)

    def start_the_rest(self) -> None:
        """synchronize(): parameters with no gradient this step take part with what
        their view holds (zeros after zero_grad), so every rank reduces every bucket."""
        for bucket in self.buckets:
            if bucket.handle is None:
                for slot, (p, view) in enumerate(zip(bucket.params, bucket.views)):
                    if p.grad is not view:
                        if p.grad is not None and p.grad.shape != view.shape:
                            self._deviated(bucket, slot, p.grad)
                        _restore_view(p, view)
                self._start(bucket)

    def wait_all(self, wait: Callable[[Any], Any]) -> list[HvdliteError]:
        """Wait for every started bucket (all of them, even after an error) and
        decompress; returns the errors, and leaves the next step a clean start."""
        errors: list[HvdliteError] = []
        for bucket in self.started:
            if bucket.handle is _FAILED:
                continue
            try:
                wait(bucket.handle)
                if bucket.wire is not None:
                    wire, context = bucket.wire
                    bucket.flat.copy_(self._compression.decompress(wire, context))
            except HvdliteError as error:
                errors.append(error)
        self.reset()
        return errors

    def reset(self) -> None:
        for bucket in self.buckets:
            bucket.waiting, bucket.handle, bucket.wire = len(bucket.params), None, None
        self.started = []
        self._passes.clear()

    @property
    def pending(self) -> bool:
        return bool(self.started)

    def zero(self) -> None:
        """zero_grad(set_to_none=False): the gradients are zeros, and views again."""
        for bucket in self.buckets:
            bucket.flat.zero_()
            for p, view in zip(bucket.params, bucket.views):
                if p.grad is not view:
                    p.grad = view


def _restore_view(param: torch.Tensor, view: torch.Tensor) -> None:
    """``.grad`` was replaced (set to None by model.zero_grad(), or assigned): copy it
    into the bucket and view it again; a missing gradient counts as zeros."""
    grad = param.grad
    if grad is None:
        view.zero_()
    elif grad.is_sparse:
        view.copy_(grad.to_dense())
    else:
        view.copy_(grad)
    param.grad = view


def agree_layout(params: list[torch.Tensor], order: Sequence[int], sparse: Sequence[int],
                 cap: int, groups: Sequence[Sequence[int]],
                 agree: Callable[[Any], Any]) -> list[list[int]]:
    """The buckets, as parameter positions, from rank 0's ``order`` and sparse
    parameters (``agree`` broadcasts them). The first step already negotiated every
    parameter by name, shape and dtype: ranks that got here train the same
    parameters, so only the order needs agreeing."""
    order, sparse = agree((list(order), sorted(sparse)))
    dense = set(range(len(params))) - set(sparse)
    return layout(params, [i for i in order if i in dense], cap,
                  [[i for i in group if i in dense] for group in groups])


def build(params: list[torch.Tensor], names: dict[int, str], plan: list[list[int]],
          shapes: list[torch.Size], adopt: bool, passes: int, compression: type[Compressor],
          op: int, predivide: float, process_set: Optional[ProcessSet]) -> Buckets:
    """Allocate the buckets of ``plan``. With ``adopt``, each parameter's current
    gradient is copied in and ``.grad`` becomes its view, one bucket at a time (each
    frees its gradients before the next is allocated); else ``.grad`` stays as it is
    (None after zero_grad) and becomes the view when its hook fires."""
    buckets = []
    for i, members in enumerate(plan):
        bucket = Bucket(i, [params[j] for j in members], [names[id(params[j])] for j in members],
                        [shapes[j] for j in members])
        if adopt:
            bucket.adopt()
        buckets.append(bucket)
    return Buckets(buckets, passes, compression, op, predivide, process_set)
