"""Scaling around a reduction: prescale before, and after it the division that
makes Average and the postscale factor. Shared by every device: ``xp`` is the
array namespace (NumPy, or CuPy on a GPU)."""
from __future__ import annotations

from typing import Any


def scale(xp: Any, buf: Any, factor: float) -> None:
    if factor != 1.0:
        # Integer tensors are scaled in float64 and truncated toward zero, as Horovod does.
        xp.multiply(buf, factor, out=buf, casting="unsafe")


class Scale:
    """Post-reduction scaling. Average divides by the size rather than multiplying
    by its reciprocal, which is not exact in float64 for a size that is not a
    power of two: 5 * (1/3) is one ulp below 5/3, and 49 * (1/49) is 0.999...,
    which truncates to 0 for integers."""
    __slots__ = ("factor", "divisor", "needed")

    def __init__(self, factor: float, divisor: int) -> None:
        self.factor, self.divisor = factor, divisor
        self.needed = divisor != 1 or factor != 1.0   # False: apply() would do nothing

    def apply(self, xp: Any, buf: Any) -> None:
        if self.divisor != 1:
            xp.true_divide(buf, self.divisor, out=buf, casting="unsafe")
        scale(xp, buf, self.factor)
