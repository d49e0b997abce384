"""The executor's scaling, without MPI: Average divides by the size (never a
multiplication by its reciprocal), scale factors truncate integers toward zero."""
from __future__ import annotations

import numpy as np
import pytest

from hvdlite.engine.scaling import Scale as _Scale, scale as _scale


@pytest.mark.parametrize("size,total", [(3, 5), (3, 7), (5, 6), (7, 5)])
def test_average_divides_rather_than_multiplying_by_the_reciprocal(size: int, total: int) -> None:
    assert total * (1.0 / size) != total / size       # the case this guards
    buf = np.full(4, float(total))
    _Scale(1.0, size).apply(np, buf)
    assert buf.tolist() == [total / size] * 4


def test_integer_average_truncates_the_exact_quotient() -> None:
    assert int(49 * (1.0 / 49)) == 0                   # the reciprocal would give 0
    buf = np.array([49, -49, 50, 97], dtype=np.int64)
    _Scale(1.0, 49).apply(np, buf)
    assert buf.tolist() == [1, -1, 1, 1]


def test_postscale_applies_after_the_division() -> None:
    buf = np.array([6.0, 9.0], dtype=np.float32)
    _Scale(2.0, 3).apply(np, buf)
    assert buf.dtype == np.float32 and buf.tolist() == [4.0, 6.0]
    ints = np.array([7, -7], dtype=np.int32)
    _Scale(0.5, 1).apply(np, ints)                     # Sum: scaled, truncated toward zero
    assert ints.tolist() == [3, -3]


def test_scale_by_one_changes_nothing_and_others_multiply() -> None:
    buf = np.array([1.5, -2.0])
    _scale(np, buf, 1.0)
    assert buf.tolist() == [1.5, -2.0]
    _scale(np, buf, 4.0)
    assert buf.tolist() == [6.0, -8.0]


def test_scaling_by_one_touches_nothing_so_large_integers_stay_exact() -> None:
    """A factor or divisor of 1 must skip the arithmetic, not apply it: int64 values
    above 2**53 do not survive the round trip through float64."""
    big = 2**53 + 1
    assert int(np.float64(big)) != big                 # the case this guards
    buf = np.array([big, -big], dtype=np.int64)
    _scale(np, buf, 1.0)
    _Scale(1.0, 1).apply(np, buf)
    assert buf.tolist() == [big, -big]
