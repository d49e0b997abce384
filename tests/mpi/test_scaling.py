"""Scale factors, Average's division and wire compression, on every path a
tensor can take through the executor: reduced in place (a lone tensor already
in its reduction dtype), packed into the fusion buffer (a group, or several
in-flight tensors), or widened (half types)."""
from __future__ import annotations

from typing import Optional

import ml_dtypes
import numpy as np
import pytest

import hvdlite as hvd

HALF_TYPES = [np.float16, ml_dtypes.bfloat16]


def _rank_total() -> float:
    """The Sum over ranks of ``rank + 1``: small, exact in every float type."""
    return float(sum(r + 1 for r in range(hvd.size())))


@pytest.mark.parametrize("dtype", [np.float64, np.float32] + HALF_TYPES,
                         ids=lambda t: np.dtype(t).name)
def test_differently_scaled_async_allreduces_are_not_fused(backend: str, dtype: type) -> None:
    """In-flight allreduces that differ only in a scale factor are submitted back to
    back, so that they are agreed in the same rounds; each keeps its own scales."""
    scales = [(1.0, 1.0), (1.0, 3.0), (5.0, 1.0)]      # (prescale, postscale): n, 3n, 5n
    name = np.dtype(dtype).name
    handles = [hvd.allreduce_async(np.full(4, hvd.rank() + 1, dtype=dtype), op=hvd.Sum,
                                   prescale_factor=pre, postscale_factor=post,
                                   name=f"scales.{backend}.{name}.{i}.{j}")
               for i in range(8) for j, (pre, post) in enumerate(scales)]
    results = [hvd.synchronize(h) for h in handles]
    n = _rank_total()
    for number, result in enumerate(results):
        pre, post = scales[number % len(scales)]
        assert result.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(result.astype(np.float64), np.full(4, n * pre * post),
                                      err_msg=f"tensor {number}: prescale {pre}, postscale {post}")


@pytest.mark.parametrize("dtype", [np.float64] + HALF_TYPES, ids=lambda t: np.dtype(t).name)
def test_scales_on_the_packed_path(backend: str, dtype: type) -> None:
    """A group is packed into the fusion buffer (half types: widened on the way);
    prescale applies before the sum, postscale and Average's division after. The
    last tensor, of another dtype, keeps the group per tensor (a group of one dtype
    is bundled into one request: tests/mpi/test_bundle.py), so the others are packed."""
    name = np.dtype(dtype).name
    other = np.float32 if dtype is np.float64 else np.float64
    tensors = [np.full(i + 2, hvd.rank() + 1, dtype=dtype) for i in range(3)]
    tensors.append(np.full(2, hvd.rank() + 1, dtype=other))
    summed = hvd.grouped_allreduce(tensors, op=hvd.Sum, prescale_factor=2.0,
                                   postscale_factor=3.0, name=f"packed.sum.{backend}.{name}")
    averaged = hvd.grouped_allreduce(tensors, op=hvd.Average, prescale_factor=4.0,
                                     postscale_factor=0.5, name=f"packed.avg.{backend}.{name}")
    lone = hvd.allreduce(tensors[0], op=hvd.Sum, prescale_factor=2.0, postscale_factor=3.0,
                         name=f"packed.lone.{backend}.{name}")
    n = _rank_total()
    for tensor, s, a in zip(tensors, summed, averaged):
        assert s.dtype == a.dtype == tensor.dtype
        np.testing.assert_array_equal(s.astype(np.float64), np.full(tensor.size, 6.0 * n))
        np.testing.assert_array_equal(a.astype(np.float64),
                                      np.full(tensor.size, 2.0 * n / hvd.size()))
    np.testing.assert_array_equal(lone.astype(np.float64), np.full(2, 6.0 * n))


def _inexact_total(size: int) -> Optional[int]:
    """A small total k whose k * (1 / size) differs from k / size in float64 (none
    for a power-of-two size, where multiplying by the reciprocal is exact)."""
    for k in range(size, 64 * size):
        if k * (1.0 / size) != k / size:
            return k
    return None


def test_average_divides_bit_exactly(backend: str) -> None:
    """Average is the sum divided by the size, not multiplied by 1/size: at np=3,
    ranks sending 1, 2, 2 must get exactly 5/3 (5 * (1/3) is one ulp less). The
    same property without MPI, at every size: tests/unit/test_scaling.py."""
    size = hvd.size()
    total = _inexact_total(size)
    if total is None:
        pytest.skip(f"at size {size} k * (1/size) == k / size for every k: run at -n 3")
    # Rank 0 sends 1, the others share the rest (size 3: 1, 2, 2).
    share, extra = divmod(total - 1, size - 1)
    mine = 1.0 if hvd.rank() == 0 else float(share + (1 if hvd.rank() <= extra else 0))
    # The float32 tensor keeps the group per tensor, so the two float64 ones are packed.
    both = hvd.grouped_allreduce([np.full(3, mine), np.full(2, mine),
                                  np.full(1, mine, dtype=np.float32)], op=hvd.Average,
                                 name=f"exact.avg.grouped.{backend}")[:2]
    bundled = hvd.grouped_allreduce([np.full(3, mine), np.full(2, mine)], op=hvd.Average,
                                    name=f"exact.avg.bundled.{backend}")
    lone = hvd.allreduce(np.full(5, mine), op=hvd.Average, name=f"exact.avg.{backend}")
    scattered = hvd.reducescatter(np.full(2 * size, mine), op=hvd.Average,
                                  name=f"exact.rs.{backend}")
    for result in both + bundled + [lone, scattered]:
        assert result.tolist() == [total / size] * result.size, (result, total, size)


@pytest.mark.parametrize("compression", ["fp16", "bf16"])
def test_compressed_reductions_return_the_input_dtype(compression: str) -> None:
    """The wire is 16 bits; the result is decompressed back to float32."""
    wire = getattr(hvd.Compression, compression)
    size, rank = hvd.size(), hvd.rank()
    x = np.full((2 * size, 3), 0.5 * (rank + 1), dtype=np.float32)
    summed = hvd.allreduce(x, op=hvd.Sum, compression=wire, name=f"cmp.ar.{compression}")
    grouped = hvd.grouped_allreduce([x, x[:1]], op=hvd.Average, compression=wire,
                                    name=f"cmp.grouped.{compression}")
    scattered = hvd.reducescatter(x, op=hvd.Sum, compression=wire, name=f"cmp.rs.{compression}")
    n = 0.5 * _rank_total()
    for result in [summed, scattered] + grouped:
        assert result.dtype == np.float32, result.dtype
    np.testing.assert_array_equal(summed, np.full((2 * size, 3), n, dtype=np.float32))
    np.testing.assert_array_equal(scattered, np.full((2, 3), n, dtype=np.float32))
    np.testing.assert_allclose(grouped[0], np.full((2 * size, 3), n / size), rtol=1e-2)
    np.testing.assert_allclose(grouped[1], np.full((1, 3), n / size), rtol=1e-2)
    ints = hvd.allreduce(np.full(3, rank, dtype=np.int32), op=hvd.Sum, compression=wire,
                         name=f"cmp.int.{compression}")   # integers are left alone
    assert ints.dtype == np.int32 and ints.tolist() == [size * (size - 1) // 2] * 3
