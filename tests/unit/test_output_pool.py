"""The output pool recycles a block only when nothing outside the pool refers to it."""
import numpy as np
import pytest

from hvdlite.api.output_pool import MIN_POOLED_BYTES, OutputPool

N = MIN_POOLED_BYTES // 4      # float32 elements in the smallest pooled output


def test_a_dropped_output_is_reused() -> None:
    pool = OutputPool(64 << 20)
    first = pool.empty((N,), np.float32)
    block = id(first.base)
    del first
    assert id(pool.empty((N,), np.float32).base) == block


@pytest.mark.parametrize("keep", ["view", "slice", "torch"])
def test_memory_still_referenced_is_never_handed_out(keep: str) -> None:
    pool = OutputPool(64 << 20)
    out = pool.empty((N,), np.float32)
    out[:] = 7.0
    if keep == "torch":
        torch = pytest.importorskip("torch")
        held = torch.from_numpy(out)
    else:
        held = out.reshape(2, -1) if keep == "view" else out[3:10]
    del out
    again = pool.empty((N,), np.float32)
    again[:] = -1.0
    assert float(held.reshape(-1)[0]) == 7.0      # untouched: a different block


def test_small_outputs_are_plain_allocations() -> None:
    assert OutputPool(64 << 20).empty((10,), np.float64).base is None
    assert OutputPool(0).empty((N,), np.float32).base is None


def test_idle_memory_stays_within_capacity() -> None:
    pool = OutputPool(2 * MIN_POOLED_BYTES)
    outs = [pool.empty((N,), np.float32) for _ in range(5)]
    del outs
    assert pool.idle_bytes() == 5 * MIN_POOLED_BYTES
    big = pool.empty((4 * N,), np.float32)     # no block fits: a new one, then a trim
    assert pool.idle_bytes() <= 2 * MIN_POOLED_BYTES
    assert big.nbytes == 4 * MIN_POOLED_BYTES


def test_shapes_and_dtypes_of_a_reused_block() -> None:
    pool = OutputPool(64 << 20)
    del_me = pool.empty((N,), np.float32)
    del del_me
    out = pool.empty((N // 4, 2), np.float64)       # same bytes, another dtype and shape
    assert out.shape == (N // 4, 2) and out.dtype == np.float64 and out.flags.c_contiguous
