"""Keras' dynamic loss scaling over a DistributedOptimizer: the step is skipped on
every rank or on none.

Keras' ``LossScaleOptimizer`` (which ``model.compile`` puts around the optimizer under
the "mixed_float16" policy) checks that the gradients it is given are finite and only
then applies them through the optimizer it wraps; otherwise it skips the step and
halves its loss scale. Around a DistributedOptimizer, the gradients it checks would be
the rank's own, and the averaging, in the wrapped ``apply``, would run only where they
are finite: a rank whose batch overflowed would skip an allreduce that the others wait
in. So when it wraps a DistributedOptimizer, its ``apply`` averages first, outside the
condition, and checks the averaged gradients. They are the same on every rank, and a
non-finite value on any rank makes them non-finite on all (an average with an inf or
a nan in it is inf or nan), so every rank skips or applies the step together and its
loss scale changes alike.

A worker-local variable's gradient is not averaged, so a rank's overflow there is
carried into a shared gradient first (plus 0 times it: +0 when finite, nan when not).
With ``backward_passes_per_step=k`` the scaled gradients are accumulated on every call
and the check is made on every k-th, on the averaged sum: the window's update is
applied or skipped whole, and the loss scale changes only then (it scales every pass of
a window alike).

``DistributedOptimizer(LossScaleOptimizer(opt))`` needs none of this: its ``apply``
averages before the loss scale optimizer sees the gradients.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator, Optional, Sequence

import keras
from keras.optimizers import LossScaleOptimizer

_plain_apply = LossScaleOptimizer.apply


def average_first(distributed: type) -> None:
    """Make a LossScaleOptimizer that wraps an instance of ``distributed`` (the
    DistributedOptimizer mixin) average before it checks; any other is left as is."""
    @functools.wraps(_plain_apply)
    def apply(self: Any, grads: Sequence[Any],
              trainable_variables: Optional[Sequence[Any]] = None) -> Any:
        inner = self.inner_optimizer
        if not isinstance(inner, distributed):
            return _plain_apply(self, grads, trainable_variables)
        entered = inner._hvdlite_support.entry_point(_averaged_then_checked)
        return entered(self, list(grads), trainable_variables)

    LossScaleOptimizer.apply = apply


def _averaged_then_checked(scaler: Any, grads: list[Any],
                           trainable_variables: Optional[Sequence[Any]]) -> Any:
    """``scaler.apply``: average (or accumulate) through the inner optimizer's step,
    then Keras' own check, skip or unscale-and-apply on the averaged gradients."""
    if not scaler.built:
        with keras.name_scope(scaler.name, caller=scaler):
            scaler.build(trainable_variables)
        scaler.built = True
    inner = scaler.inner_optimizer
    variables = list(trainable_variables if trainable_variables is not None
                     else scaler._trainable_variables)
    _carry_local_overflow(inner, grads, variables)

    def check_and_apply(averaged: list[Any], variables: list[Any]) -> Any:
        with _averaged(inner):
            return _plain_apply(scaler, averaged, trainable_variables)

    return inner._hvdlite_step(grads, variables, check_and_apply)


@contextlib.contextmanager
def _averaged(inner: Any) -> Iterator[None]:
    """The wrapped optimizer's ``apply`` gets gradients already averaged: it applies
    them as they are (it is called inside the loss scale's condition, while the
    caller traces or runs it)."""
    inner.__dict__["_hvdlite_averaged"] = True
    try:
        yield
    finally:
        inner.__dict__["_hvdlite_averaged"] = False


def _carry_local_overflow(inner: Any, grads: list[Any], variables: list[Any]) -> None:
    """Adds 0 times each worker-local gradient (summed) to the first dense shared one,
    so that a non-finite local gradient makes the average non-finite on every rank."""
    local = inner._hvdlite_reducer().local
    if not local:
        return
    local_grads = [g for g, v in zip(grads, variables) if g is not None and id(v) in local]
    shared = [i for i, (g, v) in enumerate(zip(grads, variables))
              if g is not None and id(v) not in local and not hasattr(g, "dense_shape")]
    if not local_grads or not shared:
        return
    # Each element times 0 before the sum: a sum of finite values may itself overflow.
    zeros = [keras.ops.cast(keras.ops.sum(keras.ops.multiply(
        g.values if hasattr(g, "dense_shape") else g, 0)), "float32") for g in local_grads]
    first = shared[0]
    carried = keras.ops.cast(sum(zeros[1:], zeros[0]), grads[first].dtype)
    grads[first] = keras.ops.add(grads[first], carried)
