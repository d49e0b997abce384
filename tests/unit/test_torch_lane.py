"""The torch transport's lane over Gloo (hvdlite/transport/torch_work.py, TorchLane):
its sums, reduce-scatters and allgathers against NumPy's, on real Gloo groups with a
thread per rank, segments of every size (0 included), awkward values (-0.0, inf, nan)
and both float dtypes. What the engine's lane makes of them (check words, joins) is
tests/unit/test_lane_shards.py's, on any channel."""
from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

import numpy as np
import pytest

dist = pytest.importorskip("torch.distributed")

from hvdlite.transport.torch_work import TorchLane  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def _on_ranks(size: int, body: Callable[[TorchLane, int], Any]) -> list[Any]:
    """``body(lane, rank)`` on a thread per rank, each with its own Gloo group; every
    rank's result, in rank order (a rank's error raised here)."""
    store, results, errors = dist.HashStore(), [None] * size, []

    def rank_main(rank: int) -> None:
        try:
            lane = TorchLane(dist.ProcessGroupGloo(store, rank, size), rank)
            results[rank] = body(lane, rank)
        except BaseException as exc:       # noqa: BLE001 (raised on the main thread)
            errors.append(exc)
    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(50)
    assert not any(t.is_alive() for t in threads), "a rank is still waiting"
    if errors:
        raise errors[0]
    return results


def _done(pending: Any) -> None:
    while not pending.Test():
        pass


def _values(rank: int, n: int, dtype: Any) -> np.ndarray:
    values = np.random.default_rng(rank).standard_normal(n).astype(dtype)
    awkward = np.array([-0.0, np.inf, -np.inf, np.nan], dtype)
    values[:min(n, 4)] = awkward[:min(n, 4)] if rank == 0 else values[:min(n, 4)]
    return values


def _every_size(test: Callable[..., None]) -> Callable[..., None]:
    """World sizes 1-4; 0, 1, 2, primes and 2^k+-1 elements in all; both float dtypes."""
    test = pytest.mark.parametrize("dtype", [np.float32, np.float64])(test)
    test = pytest.mark.parametrize("total", [0, 1, 2, 7, 31, 33, 257])(test)
    return pytest.mark.parametrize("size", [1, 2, 3, 4])(test)


def _counts(total: int, size: int) -> list[int]:
    return [total // size + (r < total % size) for r in range(size)]


@_every_size
def test_a_reduce_scatter_keeps_each_rank_its_segment_of_the_sum(
        size: int, total: int, dtype: Any) -> None:
    counts = _counts(total, size)
    expected = np.sum([_values(r, total, dtype) for r in range(size)], axis=0, dtype=dtype)

    def body(lane: TorchLane, rank: int) -> np.ndarray:
        out = np.full(counts[rank], 7.0, dtype)
        _done(lane.start_reduce_scatter(_values(rank, total, dtype), out, counts))
        return out
    got = _on_ranks(size, body)
    # Gloo sums in its own order: a rounding of the largest term per rank, at most.
    tolerance = size * 8 * float(np.finfo(dtype).eps)
    for rank, out in enumerate(got):
        lo = sum(counts[:rank])
        np.testing.assert_allclose(out, expected[lo:lo + counts[rank]], rtol=tolerance,
                                   atol=tolerance)


@_every_size
def test_an_allgather_puts_every_rank_s_segment_in_place_on_every_rank(
        size: int, total: int, dtype: Any) -> None:
    counts = _counts(total, size)
    parts = [_values(r, counts[r], dtype) for r in range(size)]
    expected = np.concatenate(parts) if total else np.zeros(0, dtype)

    def body(lane: TorchLane, rank: int) -> np.ndarray:
        out = np.full(total, 7.0, dtype)       # stale values, overwritten everywhere
        _done(lane.start_allgather(parts[rank].copy(), out, counts))
        return out
    outs = _on_ranks(size, body)
    for out in outs:
        np.testing.assert_array_equal(out, expected)   # -0.0 arrives as 0.0 ...
    assert len({out.tobytes() for out in outs}) == 1   # ... on every rank alike


@pytest.mark.parametrize("kinds", [("sum", "scatter", "gather"), ("gather", "scatter")])
def test_collectives_started_back_to_back_pair_up_in_order(kinds: Sequence[str]) -> None:
    """Several under way at once, as a lane starts them, each matched with the others'
    in the order started."""
    size, counts = 3, [3, 2, 2]

    def body(lane: TorchLane, rank: int) -> list[np.ndarray]:
        pending, outs = [], []
        for i, kind in enumerate(kinds):
            mine = np.full(7, float(10 * i + rank + 1))
            if kind == "sum":
                out = mine
                pending.append(lane.start_sum(mine))
            elif kind == "scatter":
                out = np.zeros(counts[rank])
                pending.append(lane.start_reduce_scatter(mine, out, counts))
            else:
                out = np.zeros(7)
                pending.append(lane.start_allgather(mine[:counts[rank]].copy(), out, counts))
            outs.append(out)
        for each in pending:
            _done(each)
        return outs
    results = _on_ranks(size, body)
    for rank, outs in enumerate(results):
        for i, (kind, out) in enumerate(zip(kinds, outs)):
            summed = sum(10 * i + r + 1 for r in range(size))
            if kind == "gather":
                want = np.repeat([10.0 * i + r + 1 for r in range(size)], counts)
            else:
                want = np.full(counts[rank] if kind == "scatter" else 7, float(summed))
            np.testing.assert_array_equal(out, want)
