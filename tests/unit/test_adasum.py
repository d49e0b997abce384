"""The Adasum pairwise formula and tree reference (no MPI), against a direct
NumPy computation of adasum(a, b) = (1 - a.b/(2|a|^2)) a + (1 - a.b/(2|b|^2)) b."""
from __future__ import annotations

import numpy as np
import pytest

from hvdlite.backends.adasum import coefficients, is_power_of_two, pairwise, tree_reference


def _direct(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    dot = float(np.dot(a, b))
    return (1 - dot / (2 * np.dot(a, a))) * a + (1 - dot / (2 * np.dot(b, b))) * b


def test_random_vectors_match_the_formula() -> None:
    rng = np.random.default_rng(7)
    a, b = rng.standard_normal(50), rng.standard_normal(50)
    np.testing.assert_allclose(pairwise(a, b), _direct(a, b), rtol=1e-12)


def test_orthogonal_vectors_add() -> None:
    a, b = np.array([3.0, 0.0, 0.0]), np.array([0.0, -2.0, 5.0])
    np.testing.assert_allclose(pairwise(a, b), a + b, rtol=0, atol=0)


def test_equal_parallel_vectors_average() -> None:
    a = np.array([1.5, -2.0, 4.0])
    np.testing.assert_allclose(pairwise(a, a.copy()), a, rtol=1e-15)


def test_zero_vector_contributes_as_in_a_sum() -> None:
    a, zero = np.array([1.0, 2.0, -3.0]), np.zeros(3)
    np.testing.assert_array_equal(pairwise(a, zero), a)
    np.testing.assert_array_equal(pairwise(zero, a), a)
    np.testing.assert_array_equal(pairwise(zero, zero), zero)
    assert coefficients(0.0, 0.0, 0.0) == (1.0, 1.0)


def test_float32_keeps_its_dtype_and_shape() -> None:
    rng = np.random.default_rng(3)
    a = rng.standard_normal((4, 5)).astype(np.float32)
    b = rng.standard_normal((4, 5)).astype(np.float32)
    out = pairwise(a, b)
    assert out.dtype == np.float32 and out.shape == (4, 5)
    expected = _direct(a.ravel().astype(np.float64), b.ravel().astype(np.float64))
    np.testing.assert_allclose(out.ravel(), expected, rtol=1e-6)


def test_tree_brackets_neighbours_first() -> None:
    rng = np.random.default_rng(11)
    v = [rng.standard_normal(8) for _ in range(4)]
    expected = _direct(_direct(v[0], v[1]), _direct(v[2], v[3]))
    np.testing.assert_allclose(tree_reference(v), expected, rtol=1e-12)
    np.testing.assert_array_equal(tree_reference(v[:1]), v[0])
    with pytest.raises(ValueError, match="power-of-two"):
        tree_reference(v[:3])


@pytest.mark.parametrize("n,expected", [(1, True), (2, True), (3, False), (4, True),
                                        (5, False), (6, False), (0, False), (512, True),
                                        (96, False)])
def test_power_of_two(n: int, expected: bool) -> None:
    assert is_power_of_two(n) is expected


def test_a_norm_exactly_at_the_threshold_takes_the_formula() -> None:
    # Horovod's threshold is sqrt(DBL_MIN) = 2^-511, inclusive: a squared norm equal to
    # it gets the formula, one below it keeps coefficient 1 (as in a plain sum).
    at = np.full(2, 2.0 ** -256)        # |at|^2 = 2 * 2^-512 = 2^-511 exactly
    below = np.full(1, 2.0 ** -256)     # |below|^2 = 2^-512
    assert float(at @ at) == 2.0 ** -511
    np.testing.assert_array_equal(pairwise(at, at.copy()), at)          # averaged
    np.testing.assert_array_equal(pairwise(below, below.copy()), 2 * below)   # summed
    tiny = 2.0 ** -511
    assert coefficients(tiny, tiny, 4.0 * tiny) == (0.5, 0.875)
    assert coefficients(tiny, 1.0, tiny) == (1.0 - tiny / 2.0, 0.5)
