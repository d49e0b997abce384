"""Allreduce against NumPy references built from every rank's data."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import hvdlite as hvd
from tests.mpi.conftest import rank_data

INT_TYPES = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]
FLOAT_TYPES = [np.float16, ml_dtypes.bfloat16, np.float32, np.float64]
COMPLEX_TYPES = [np.complex64, np.complex128]
ALL_TYPES = INT_TYPES + FLOAT_TYPES + COMPLEX_TYPES
OPS = {hvd.Sum: np.sum, hvd.Min: np.min, hvd.Max: np.max, hvd.Product: np.prod}


def _reference(op: int, dtype: type, shape: tuple[int, ...], salt: int) -> np.ndarray:
    stack = np.stack([rank_data(r, shape, dtype, salt).astype(np.float64 if dtype not in
                      COMPLEX_TYPES else np.complex128) for r in range(hvd.size())])
    if op == hvd.Average:
        total = stack.sum(axis=0)
        if np.issubdtype(np.dtype(dtype), np.integer):
            return np.trunc(total / hvd.size()).astype(dtype)
        return (total / hvd.size()).astype(dtype)
    return OPS[op](stack, axis=0).astype(dtype)


@pytest.mark.parametrize("dtype", ALL_TYPES, ids=lambda t: np.dtype(t).name)
@pytest.mark.parametrize("op", [hvd.Sum, hvd.Min, hvd.Max, hvd.Product, hvd.Average],
                         ids=lambda o: hvd.ReduceOp(o).name)
def test_every_op_and_dtype(backend: str, dtype: type, op: int) -> None:
    if dtype in COMPLEX_TYPES and op in (hvd.Min, hvd.Max):
        pytest.skip("Min/Max are undefined for complex numbers (tested as an error)")
    if op == hvd.Product and hvd.size() > 4:
        pytest.skip("values up to 3**size would overflow int8")
    shape = (3, 5)
    salt = int(op) * 100 + ALL_TYPES.index(dtype)
    data = rank_data(hvd.rank(), shape, dtype, salt)
    result = hvd.allreduce(data, op=op, name=f"every.{backend}.{op}.{np.dtype(dtype).name}")
    expected = _reference(op, dtype, shape, salt)
    assert result.dtype == np.dtype(dtype)
    assert result.shape == shape
    if op == hvd.Average and not np.issubdtype(np.dtype(dtype), np.integer):
        np.testing.assert_allclose(result.astype(np.complex128), expected.astype(np.complex128),
                                   rtol=1e-2 if np.dtype(dtype).itemsize <= 2 else 1e-6)
    else:
        np.testing.assert_array_equal(result, expected)


def test_default_op_is_average() -> None:
    result = hvd.allreduce(np.full(4, float(hvd.rank())), name="default_average")
    np.testing.assert_allclose(result, np.full(4, (hvd.size() - 1) / 2))


@pytest.mark.parametrize("pre,post", [(2.0, 1.0), (1.0, 0.5), (0.5, 3.0)])
def test_prescale_and_postscale(backend: str, pre: float, post: float) -> None:
    x = np.arange(6, dtype=np.float64) + hvd.rank()
    result = hvd.allreduce(x, op=hvd.Sum, prescale_factor=pre, postscale_factor=post,
                           name=f"scale.{backend}.{pre}.{post}")
    expected = sum(np.arange(6) + r for r in range(hvd.size())) * pre * post
    np.testing.assert_allclose(result, expected)


def test_average_with_scales_on_half() -> None:
    x = np.full(8, hvd.rank() + 1, dtype=np.float16)
    result = hvd.allreduce(x, op=hvd.Average, postscale_factor=2.0, name="avg.half.scaled")
    expected = 2.0 * sum(r + 1 for r in range(hvd.size())) / hvd.size()
    np.testing.assert_allclose(result.astype(np.float32), expected, rtol=1e-3)


@pytest.mark.parametrize("nbytes", [0, 4, 3 << 20, 9 << 20])
def test_sizes_across_backend_switch_points(backend: str, nbytes: int) -> None:
    """Empty tensors, the latency case, and sizes above the ring threshold."""
    n = nbytes // 4
    x = np.arange(n, dtype=np.float32) % 97 * (hvd.rank() + 1)
    result = hvd.allreduce(x, op=hvd.Sum, name=f"size.{backend}.{nbytes}")
    np.testing.assert_array_equal(result, np.arange(n, dtype=np.float32) % 97 *
                                  sum(range(1, hvd.size() + 1)))


_REDUCERS = {"Sum": np.sum, "Average": np.mean, "Min": np.min, "Max": np.max,
             "Product": np.prod}


@pytest.mark.parametrize("op_name", sorted(_REDUCERS))
@pytest.mark.parametrize("n", [1, 1001, 3 << 18])
def test_allocating_form_reads_its_input_only(backend: str, op_name: str, n: int) -> None:
    """out = allreduce(x) reduces out of place: x is never written, the output holds
    the reduction of every rank's x (3 << 18 float64 is 6 MiB, ring-sized in auto)."""
    def contribution(rank: int) -> np.ndarray:
        return (np.arange(n) % 7 + rank + 1).astype(np.float64)
    x = contribution(hvd.rank())
    result = hvd.allreduce(x, op=getattr(hvd, op_name), name=f"oop.{backend}.{op_name}.{n}")
    expected = _REDUCERS[op_name](np.stack([contribution(r) for r in range(hvd.size())]), axis=0)
    assert result is not x
    np.testing.assert_array_equal(x, contribution(hvd.rank()))
    np.testing.assert_allclose(result, expected, rtol=1e-15)


def test_inplace_and_noncontiguous(backend: str) -> None:
    base = np.arange(40, dtype=np.float64).reshape(5, 8) * (hvd.rank() + 1)
    view = base[:, ::2]                       # non-contiguous input
    result = hvd.allreduce(view, op=hvd.Sum, name=f"noncontig.{backend}")
    factor = sum(range(1, hvd.size() + 1))
    np.testing.assert_array_equal(result, np.arange(40.0).reshape(5, 8)[:, ::2] * factor)
    returned = hvd.allreduce_(view, op=hvd.Sum, name=f"noncontig_.{backend}")
    assert returned is view
    np.testing.assert_array_equal(base[:, ::2], np.arange(40.0).reshape(5, 8)[:, ::2] * factor)
    np.testing.assert_array_equal(base[:, 1::2], np.arange(40.0).reshape(5, 8)[:, 1::2]
                                  * (hvd.rank() + 1))   # untouched columns stay


def test_grouped_allreduce() -> None:
    tensors = [np.full((i + 1, 2), float(hvd.rank() + i)) for i in range(5)]
    results = hvd.grouped_allreduce(tensors, op=hvd.Sum, name="grouped")
    for i, result in enumerate(results):
        np.testing.assert_array_equal(result, np.full((i + 1, 2), float(
            sum(r + i for r in range(hvd.size())))))
    inplace = [np.ones(3) * hvd.rank() for _ in range(3)]
    hvd.grouped_allreduce_(inplace, op=hvd.Max, name="grouped_")
    for tensor in inplace:
        np.testing.assert_array_equal(tensor, np.full(3, hvd.size() - 1.0))


def test_500_small_tensors_in_different_orders(backend: str) -> None:
    """Every rank submits the same 500 names in its own order; all complete."""
    order = np.random.default_rng(hvd.rank()).permutation(500)
    handles = {}
    for i in order:
        handles[i] = hvd.allreduce_async(np.full(256, float(i + hvd.rank())), op=hvd.Sum,
                                         name=f"many.{backend}.{i}")
    for i in range(500):
        expected = sum(i + r for r in range(hvd.size()))
        np.testing.assert_array_equal(hvd.synchronize(handles[i]), np.full(256, float(expected)))


def test_steady_state_repeats_use_cache(backend: str) -> None:
    """The same names every step (the cached fast path) keep giving right answers,
    including when one step's values change."""
    for step in range(30):
        grads = [np.full(10 * (j + 1), float(step * hvd.rank() + j)) for j in range(4)]
        handles = [hvd.allreduce_async(g, op=hvd.Sum, name=f"step.{backend}.{j}")
                   for j, g in enumerate(grads)]
        for j, h in enumerate(handles):
            expected = sum(step * r + j for r in range(hvd.size()))
            np.testing.assert_array_equal(hvd.synchronize(h), np.full(10 * (j + 1), float(expected)))


def test_poll_and_unnamed_ops() -> None:
    handle = hvd.allreduce_async(np.ones(3), op=hvd.Sum)
    result = hvd.synchronize(handle)
    np.testing.assert_array_equal(result, np.full(3, float(hvd.size())))
    handle = hvd.allreduce_async(np.ones(3), op=hvd.Sum)
    while not hvd.poll(handle):
        pass
    np.testing.assert_array_equal(hvd.synchronize(handle), np.full(3, float(hvd.size())))


def test_recycled_outputs_never_overwrite_held_results(backend: str) -> None:
    """Large outputs come from recycled memory: results still held (as arrays or
    views) keep their values while later allreduces run."""
    n = (2 << 20) // 8                       # 2 MiB of float64: pooled
    held = []
    for step in range(6):
        out = hvd.allreduce(np.full(n, float(step + hvd.rank())), op=hvd.Sum,
                            name=f"recycle.{backend}.{step}")
        if step % 2 == 0:
            held.append((step, out[::1000]))  # a view keeps the block alive
    for step, view in held:
        expected = sum(step + r for r in range(hvd.size()))
        np.testing.assert_array_equal(view, np.full(view.shape, float(expected)))
