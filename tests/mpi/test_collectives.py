"""Allgather, broadcast, alltoall, reducescatter, barrier, join, process sets, objects."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import hvdlite as hvd
from tests.mpi.conftest import rank_data
from tests.mpi.outcomes import under_torchrun

DTYPES = [np.int8, np.uint16, np.int64, np.float16, ml_dtypes.bfloat16, np.float32,
          np.float64, np.complex64, np.bool_]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: np.dtype(t).name)
def test_allgather_with_per_rank_first_dims(dtype: type) -> None:
    mine = rank_data(hvd.rank(), (hvd.rank() + 1, 3), np.int64, salt=7).astype(dtype)
    result = hvd.allgather(mine, name=f"gather.{np.dtype(dtype).name}")
    expected = np.concatenate([rank_data(r, (r + 1, 3), np.int64, salt=7).astype(dtype)
                               for r in range(hvd.size())])
    assert result.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(result, expected)


def test_allgather_scalar_and_empty_rank() -> None:
    np.testing.assert_array_equal(hvd.allgather(np.int32(hvd.rank()), name="gather.scalar"),
                                  np.arange(hvd.size(), dtype=np.int32))
    mine = np.ones((0 if hvd.rank() == 0 else 2, 2))
    assert hvd.allgather(mine, name="gather.empty").shape == (2 * (hvd.size() - 1), 2)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: np.dtype(t).name)
def test_broadcast_from_every_root(dtype: type) -> None:
    for root in range(hvd.size()):
        mine = rank_data(hvd.rank(), (4, 2), np.int64, salt=3).astype(dtype)
        result = hvd.broadcast(mine, root_rank=root, name=f"bcast.{root}.{np.dtype(dtype).name}")
        np.testing.assert_array_equal(result, rank_data(root, (4, 2), np.int64, salt=3).astype(dtype))


def test_broadcast_inplace() -> None:
    x = np.full(5, float(hvd.rank()))
    assert hvd.broadcast_(x, root_rank=hvd.size() - 1, name="bcast_") is x
    np.testing.assert_array_equal(x, np.full(5, hvd.size() - 1.0))


def _splits(sender: int, size: int) -> list[int]:
    return [(sender + dest) % 3 for dest in range(size)]   # uneven, some zero


def test_alltoall_uneven_splits() -> None:
    rank, size = hvd.rank(), hvd.size()
    splits = _splits(rank, size)
    rows = np.concatenate([np.full((n, 2), 100 * rank + dest) for dest, n in enumerate(splits)]
                          ) if sum(splits) else np.zeros((0, 2))
    received, recv_splits = hvd.alltoall(rows.astype(np.int32), splits=splits, name="a2a")
    expected_splits = [_splits(src, size)[rank] for src in range(size)]
    np.testing.assert_array_equal(recv_splits, expected_splits)
    expected = [np.full((_splits(src, size)[rank], 2), 100 * src + rank) for src in range(size)]
    np.testing.assert_array_equal(received, np.concatenate(expected).astype(np.int32))


def test_alltoall_default_even_splits() -> None:
    x = np.arange(hvd.size() * 2, dtype=np.float64) + 10 * hvd.rank()
    received = hvd.alltoall(x, name="a2a.even")      # Horovod: no splits in, no splits out
    explicit, splits = hvd.alltoall(x, splits=[2] * hvd.size(), name="a2a.even.explicit")
    np.testing.assert_array_equal(splits, np.full(hvd.size(), 2))
    expected = np.concatenate([np.arange(2 * hvd.rank(), 2 * hvd.rank() + 2) + 10 * src
                               for src in range(hvd.size())])
    np.testing.assert_array_equal(received, expected)
    np.testing.assert_array_equal(explicit, expected)


@pytest.mark.parametrize("rows", [1, 5, 7, 16])
@pytest.mark.parametrize("op", [hvd.Sum, hvd.Average, hvd.Max])
def test_reducescatter_lengths_not_divisible(backend: str, rows: int, op: int) -> None:
    size, rank = hvd.size(), hvd.rank()
    data = np.arange(rows * 3, dtype=np.float64).reshape(rows, 3) * (rank + 1)
    result = hvd.reducescatter(data, op=op, name=f"rs.{backend}.{rows}.{op}")
    stack = np.stack([np.arange(rows * 3, dtype=np.float64).reshape(rows, 3) * (r + 1)
                      for r in range(size)])
    full = {hvd.Sum: stack.sum(0), hvd.Average: stack.mean(0), hvd.Max: stack.max(0)}[op]
    counts = [rows // size + (1 if r < rows % size else 0) for r in range(size)]
    start = sum(counts[:rank])
    np.testing.assert_allclose(result, full[start:start + counts[rank]])


def test_reducescatter_half_precision() -> None:
    data = np.ones((hvd.size() * 2, 4), dtype=np.float16)
    result = hvd.reducescatter(data, op=hvd.Sum, name="rs.half")
    assert result.dtype == np.float16 and result.shape == (2, 4)
    np.testing.assert_array_equal(result, np.full((2, 4), hvd.size(), dtype=np.float16))


def _dirty_fusion_buffer() -> None:
    """Leave non-zero data in this rank's fusion buffer (a fused group), so that a
    joined rank that failed to contribute zeros would show up in the sum."""
    hvd.grouped_allreduce([np.full(16, 1000.0), np.full(16, 1000.0), np.zeros(1, np.int64)],
                          op=hvd.Sum, name="join.dirty")   # two dtypes: not bundled, packed


# Join tests assert only after every rank's last collective: a rank that failed an
# assertion before join() would leave the others waiting in it.
def test_barrier_and_join_with_uneven_batches() -> None:
    hvd.barrier()
    _dirty_fusion_buffer()
    batches = hvd.rank() + 1            # rank r has r + 1 batches; the last rank has most
    totals = [hvd.allreduce(np.ones(4), op=hvd.Sum, name="join.batch") for _ in range(batches)]
    last = hvd.join()
    # After everyone joined, collectives work normally again.
    after = hvd.allreduce(np.ones(2), op=hvd.Sum, name="after.join")
    for step, total in enumerate(totals):
        active = sum(1 for r in range(hvd.size()) if r + 1 > step)   # joined ranks add zeros
        np.testing.assert_array_equal(total, np.full(4, float(active)), err_msg=f"step {step}")
    assert last == hvd.size() - 1
    np.testing.assert_array_equal(after, np.full(2, float(hvd.size())))


def test_join_average_divides_by_full_size() -> None:
    _dirty_fusion_buffer()
    result = None
    if hvd.rank() != 0:
        result = hvd.allreduce(np.full(3, 6.0), op=hvd.Average, name="join.avg")
    last = hvd.join()
    if result is not None:
        np.testing.assert_allclose(result, np.full(3, 6.0 * (hvd.size() - 1) / hvd.size()))
    assert last == 0 if hvd.size() == 1 else 0 < last < hvd.size()   # rank 0 joined first


def test_process_sets_negotiate_on_their_own() -> None:
    size, rank = hvd.size(), hvd.rank()
    evens = hvd.add_process_set(hvd.ProcessSet(range(0, size, 2)))
    odds = hvd.add_process_set(range(1, size, 2))
    mine = evens if rank % 2 == 0 else odds
    assert mine.included() and mine.rank() == mine.ranks.index(rank)
    total = hvd.allreduce(np.array([float(rank)]), op=hvd.Sum, name="ps.sum", process_set=mine)
    np.testing.assert_array_equal(total, [float(sum(mine.ranks))])
    gathered = hvd.allgather(np.array([rank]), name="ps.gather", process_set=mine)
    np.testing.assert_array_equal(gathered, mine.ranks)
    root_value = hvd.broadcast(np.array([rank]), root_rank=mine.ranks[-1], name="ps.bcast",
                               process_set=mine)
    np.testing.assert_array_equal(root_value, [mine.ranks[-1]])
    other = odds if mine is evens else evens
    with pytest.raises(ValueError, match="not in"):
        hvd.allreduce(np.ones(1), name="ps.outsider", process_set=other)
    with pytest.raises(ValueError, match="already registered"):
        hvd.add_process_set(list(mine.ranks))
    assert hvd.remove_process_set(evens) and hvd.remove_process_set(odds)
    assert not hvd.remove_process_set(evens)
    np.testing.assert_array_equal(hvd.allreduce(np.ones(1), op=hvd.Sum, name="ps.after"),
                                  [float(size)])


def test_process_set_root_is_a_global_rank() -> None:
    """As in Horovod, root_rank names a global rank, for tensors and objects; a rank
    outside the set is refused on every member, and the set stays usable."""
    size, rank = hvd.size(), hvd.rank()
    if size < 2:
        pytest.skip("needs a set that differs from the world")
    odds = hvd.add_process_set(range(1, size, 2))     # set rank 0 is global rank 1
    try:
        if rank % 2 == 1:
            for root in odds.ranks:
                value = hvd.broadcast(np.array([rank]), root_rank=root, name=f"gr.{root}",
                                      process_set=odds)
                np.testing.assert_array_equal(value, [root])
                assert hvd.broadcast_object(("o", rank), root_rank=root,
                                            process_set=odds) == ("o", root)
            with pytest.raises(ValueError, match="not a member of process set"):
                hvd.broadcast(np.ones(2), root_rank=0, name="gr.outsider", process_set=odds)
            total = hvd.allreduce(np.ones(1), op=hvd.Sum, name="gr.after", process_set=odds)
            np.testing.assert_array_equal(total, [float(len(odds.ranks))])
    finally:
        hvd.remove_process_set(odds)


def test_objects() -> None:
    value = hvd.broadcast_object({"epoch": 3, "rank": hvd.rank()}, root_rank=hvd.size() - 1)
    assert value == {"epoch": 3, "rank": hvd.size() - 1}
    gathered = hvd.allgather_object(("r", hvd.rank(), "x" * hvd.rank()))
    assert gathered == [("r", r, "x" * r) for r in range(hvd.size())]


def test_topology_queries_are_consistent() -> None:
    assert 0 <= hvd.local_rank() < hvd.local_size() and 0 <= hvd.cross_rank() < hvd.cross_size()
    assert hvd.local_size() * hvd.cross_size() == hvd.size() or not hvd.is_homogeneous()
    ranks = hvd.allgather_object((hvd.rank(), hvd.local_rank(), hvd.cross_rank()))
    assert sorted(r for r, _, _ in ranks) == list(range(hvd.size()))
    assert len({(lr, cr) for _, lr, cr in ranks}) == hvd.size()   # (local, cross) is unique
    # Under torchrun MPI need not be installed (make test-gloo's venv has no mpi4py).
    assert hvd.mpi_threads_supported() in (True, False) and (hvd.mpi_built() or under_torchrun())
    assert hvd.gloo_enabled() == under_torchrun() and hvd.mpi_enabled() != under_torchrun()


@pytest.mark.skipif(not under_torchrun(), reason="MPI has it: tested by the Adasum tests")
def test_the_torch_transport_refuses_what_it_lacks_on_every_rank() -> None:
    """Under torchrun, Adasum is a NotSupportedError on every rank (not an engine failure
    ending the job), and the next collective still runs."""
    with pytest.raises(hvd.NotSupportedError, match="Adasum needs MPI"):
        hvd.allreduce(np.ones(4), op=hvd.Adasum, name="lacks.adasum")
    total = hvd.allreduce(np.ones(2), op=hvd.Sum, name="lacks.after")
    assert total.tolist() == [float(hvd.size())] * 2


def test_unsigned_64_bit_order_and_16_bit_wrapping_as_mpi_reduces_them() -> None:
    """Gloo has neither type: the torch transport reduces uint64 as int64 with the sign bit
    flipped for Min and Max, and int16 as int32 narrowed after. Values on both sides of
    2**63 tell a signed order from an unsigned one; 30000 a rank overflows int16."""
    rank, size = hvd.rank(), hvd.size()
    mixed = np.array([1 if rank == 0 else 2**63 + rank, 7], dtype=np.uint64)
    top = hvd.allreduce(mixed, op=hvd.Max, name="u64.max")
    low = hvd.allreduce(mixed, op=hvd.Min, name="u64.min")
    assert top.tolist() == [2**63 + size - 1, 7] and low.tolist() == [1, 7]
    wrapped = hvd.allreduce(np.full(3, 30000, dtype=np.int16), op=hvd.Sum, name="i16.sum")
    assert wrapped.dtype == np.int16
    assert wrapped.tolist() == [int(np.array([30000 * size]).astype(np.int16)[0])] * 3
