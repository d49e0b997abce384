"""``torch.amp.GradScaler`` with the DistributedOptimizer, whichever way a script calls it.

The scaler decides to skip a step from the gradients it finds in ``.grad``: it unscales
them and looks for an inf or a nan (``unscale_``, which ``scaler.step`` calls when the
script has not), and halves its scale if it found one. Each rank must decide from the
averaged gradients, the same on every rank, or a rank whose batch overflowed skips the
step alone, its scale halves alone, and the ranks' parameters part.

Horovod's recipe averages first (``synchronize()``, then ``unscale_``). torch's own
recipe calls ``scaler.step(optimizer)`` straight after ``backward()``, while the
reductions are still in flight. Before it reads any gradient, ``scaler.step`` asks the
optimizer whether it handles scaling itself (``_step_supports_amp_scaling``): the
DistributedOptimizer averages the gradients there, so the scaler's check sees what it
sees after ``synchronize()``, and the step that follows reduces nothing twice. An
optimizer that does handle scaling itself (``fused=True`` Adam) gets the scaler's
``grad_scale`` and ``found_inf``, which the scaler sets on the wrapper, for its step.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

# What GradScaler sets on an optimizer that handles scaling itself, for its step.
_SCALER_ATTRIBUTES = ("grad_scale", "found_inf")


class GradScalerSupport:
    """Mixed into the DistributedOptimizer (hvdlite/torch/optimizer.py)."""

    _optimizer: Any
    _should_synchronize: bool
    _synchronized: bool
    _synchronized_for_scaler: bool
    synchronize: Callable[[], None]
    # Set by the step's first gradient (its hook compares requires_grad with the layout),
    # cleared by synchronize(): whether this step's gradients have begun to arrive.
    _layout_checked: bool

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """Asked by ``GradScaler.step`` before it reads a gradient: the gradients are
        averaged here (unless the script did, or steps under ``skip_synchronize()``),
        and the answer is the wrapped optimizer's. Only once this step's gradients
        have begun to arrive: asked at any other time (by a library, on one rank), it
        starts no collective; a rank that had no gradient averages in ``step()``."""
        if self._should_synchronize and not self._synchronized and self._layout_checked:
            self.synchronize()
            self._synchronized_for_scaler = True
        return bool(getattr(self._optimizer, "_step_supports_amp_scaling", False))

    @contextlib.contextmanager
    def _scaler_attributes_forwarded(self) -> Iterator[None]:
        """The scaler's ``grad_scale`` and ``found_inf``, set on this wrapper, visible
        to the wrapped optimizer's step, and taken back after it."""
        given = [name for name in _SCALER_ATTRIBUTES if name in self.__dict__]
        for name in given:
            setattr(self._optimizer, name, self.__dict__[name])
        try:
            yield
        finally:
            for name in given:
                if name in vars(self._optimizer):
                    delattr(self._optimizer, name)
