"""The executor's allreduce without MPI processes, at 1 to 4 ranks in one process
(tests/unit/executor_ranks.py): fused groups of one dtype or several (half types
widened), lone tensors reduced in their own output, prescale, postscale and
Average's division, joined ranks' zeros and in-place results written back into
strided targets. Expected values come from rank and size."""
from __future__ import annotations

from typing import Any, Optional

import numpy as np
import pytest

from hvdlite.negotiation.requests import Kind, ReduceOp, Request, Response
from tests.unit.executor_ranks import (BF16, SET, SIZES, UFUNCS, Ranks, allreduce, contribution,
                                       desc, expected, fake_requests, on_ranks, responses_for)


@pytest.fixture(autouse=True)
def _fake_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_requests(monkeypatch)

# --- allreduce: fused groups -----------------------------------------------------------

FUSED_SHAPES = [(5,), (2, 3), (), (0,), (4, 1)]


@pytest.mark.parametrize("backend", ["mpi", "ring", "ps"])
@pytest.mark.parametrize("op", list(UFUNCS))
@pytest.mark.parametrize("size", SIZES)
def test_a_fused_group_of_one_dtype(size: int, op: ReduceOp, backend: str) -> None:
    def make(rank: int) -> list[Request]:
        return [allreduce(f"t{i}", contribution(rank, shape, np.float32, i), op)
                for i, shape in enumerate(FUSED_SHAPES)]

    def steps(me: Ranks) -> None:
        requests = make(me.rank)
        inputs = [r.array.copy() for r in requests]
        results = me.run(requests, responses_for(make))
        for i, request in enumerate(requests):
            want = expected([make(r)[i].array for r in range(size)], request.array, op)
            got = results[request.desc.name]
            assert got is request.output and got.dtype == np.float32
            assert got.shape == FUSED_SHAPES[i] and got.tolist() == want.tolist()
            assert request.array.tolist() == inputs[i].tolist()     # inputs untouched
        # One reduction for the whole group, by the configured backend.
        assert me.calls == [(backend, "allreduce")]
    on_ranks(size, steps, allreduce=backend)


@pytest.mark.parametrize("size", SIZES)
def test_mixed_dtypes_are_fused_per_dtype_and_half_types_reduce_widened(size: int) -> None:
    dtypes = [np.float32, np.float16, np.int32, BF16, np.float64, np.float16, np.int32,
              np.float32, BF16]
    # Large enough that a half-type sum is exact only when reduced in float32.
    scale = 300

    def make(rank: int) -> list[Request]:
        return [allreduce(f"m{i}", (contribution(rank, (3 + i,), np.float64, i) * scale + rank
                                    ).astype(dt), ReduceOp.AVERAGE) for i, dt in enumerate(dtypes)]

    def steps(me: Ranks) -> None:
        requests = make(me.rank)
        results = me.run(requests, responses_for(make))
        for i, request in enumerate(requests):
            want = expected([make(r)[i].array for r in range(size)], request.array,
                            ReduceOp.AVERAGE)
            got = results[request.desc.name]
            assert got.dtype == request.array.dtype
            assert got.astype(np.float64).tolist() == want.astype(np.float64).tolist()
        assert len(me.calls) == 5           # float32, float16, int32, bfloat16, float64 groups
    on_ranks(size, steps, allreduce="mpi")


def test_half_types_sum_in_float32() -> None:
    """2048 + 1 + 1 is 2050 in float32 but 2048 when float16 rounds each partial
    sum (and 256 + 1 + 1 in bfloat16)."""
    def make(rank: int) -> list[Request]:
        return [allreduce("h", np.full(3, 2048.0 if rank == 0 else 1.0, np.float16)),
                allreduce("b", np.full(2, 256.0 if rank == 0 else 1.0, BF16))]

    def steps(me: Ranks) -> tuple[list, list]:
        results = me.run(make(me.rank), responses_for(make))
        return results["h"].tolist(), results["b"].astype(np.float32).tolist()
    for half, bfloat in on_ranks(3, steps):
        # float16 holds 2048 and 2050 exactly, bfloat16 holds 256.
        assert half == [2050.0] * 3 and bfloat == [258.0] * 2


@pytest.mark.parametrize("backend", ["mpi", "ring"])
def test_average_divides_exactly_at_size_three(backend: str) -> None:
    """Ranks send 1, 2, 2: the result is 5/3 exactly, not 5 * (1/3) (one ulp below)."""
    def make(rank: int) -> list[Request]:
        value = 1.0 if rank == 0 else 2.0
        return [allreduce("avg", np.full(6, value), ReduceOp.AVERAGE),
                allreduce("avg2", np.full(2, value * 7), ReduceOp.AVERAGE)]

    def steps(me: Ranks) -> tuple[list, list]:
        results = me.run(make(me.rank), responses_for(make))
        return results["avg"].tolist(), results["avg2"].tolist()
    assert 5 * (1 / 3) != 5 / 3
    for avg, avg2 in on_ranks(3, steps, allreduce=backend):
        assert avg == [5 / 3] * 6 and avg2 == [35 / 3] * 2


@pytest.mark.parametrize("dtype", [np.float64, np.int64, np.float16])
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.AVERAGE, ReduceOp.MAX])
@pytest.mark.parametrize("size", [1, 3, 4])
def test_prescale_and_postscale(size: int, op: ReduceOp, dtype: Any) -> None:
    """Prescale before the reduction (integers truncate per rank), postscale after
    the division; the same for fused groups and lone tensors reduced directly."""
    pre, post = 0.5, 3.0

    def make(rank: int) -> list[Request]:
        return [allreduce(f"s{i}", contribution(rank, (4 + 60 * (i == 2),), dtype, i) * 3 + 1,
                          op, prescale=pre, postscale=post, inplace=i == 1) for i in range(3)]

    def steps(me: Ranks) -> None:
        requests = make(me.rank)
        inputs = [r.array.copy() for r in requests]
        results = me.run(requests, responses_for(make))
        for i, request in enumerate(requests):
            want = expected([make(r)[i].array for r in range(size)], inputs[i], op, pre, post)
            assert results[request.desc.name].tolist() == want.tolist()
        assert requests[2].array.tolist() == inputs[2].tolist()    # out of place, alone
    # s2 (480+ bytes) is reduced alone when it is already in its reduction dtype.
    on_ranks(size, steps, allreduce="mpi", direct_threshold=400)


# --- allreduce: lone large tensors, reduced directly ----------------------------------

@pytest.mark.parametrize("backend", ["mpi", "ring", "ps"])
@pytest.mark.parametrize("inplace", [True, False])
@pytest.mark.parametrize("prescale", [1.0, 2.0])
@pytest.mark.parametrize("size", SIZES)
def test_a_lone_large_tensor_is_reduced_in_its_own_output(size: int, prescale: float,
                                                          inplace: bool, backend: str) -> None:
    shape = (3, 50)

    def make(rank: int) -> list[Request]:
        return [allreduce("big", contribution(rank, shape, np.float64), ReduceOp.AVERAGE,
                          inplace=inplace, prescale=prescale, postscale=0.5)]

    def steps(me: Ranks) -> None:
        (request,) = make(me.rank)
        before = request.array.copy()
        output = request.output
        results = me.run([request], responses_for(make))
        want = expected([make(r)[0].array for r in range(size)], before, ReduceOp.AVERAGE,
                        prescale, 0.5)
        assert results["big"] is output and output.tolist() == want.tolist()
        if not inplace:
            assert request.array.tolist() == before.tolist()
        # No fusion buffer: nothing was packed.
        assert me.executor._fusion_work == {}
        if inplace or prescale != 1.0:
            assert me.calls == [(backend, "allreduce")]
        else:   # read straight from the input
            assert me.calls == [(backend, "allreduce_from")]
    on_ranks(size, steps, allreduce=backend, direct_threshold=1024)


@pytest.mark.parametrize("size", [2, 3])
def test_a_lone_widened_tensor_goes_through_the_fusion_buffer(size: int) -> None:
    def make(rank: int) -> list[Request]:
        return [allreduce("half", contribution(rank, (600,), np.float16), inplace=True)]

    def steps(me: Ranks) -> None:
        (request,) = make(me.rank)
        want = expected([make(r)[0].array for r in range(size)], request.array, ReduceOp.SUM)
        output = request.output
        results = me.run([request], responses_for(make))
        assert results["half"] is output and output.tolist() == want.tolist()
        assert set(me.executor._fusion_work) == {"cpu"}
    on_ranks(size, steps, allreduce="mpi", direct_threshold=1024)


# --- allreduce: joined ranks ------------------------------------------------------------

@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.AVERAGE, ReduceOp.MIN, ReduceOp.MAX,
                                ReduceOp.PRODUCT])
@pytest.mark.parametrize("size", [2, 3, 4])
def test_joined_ranks_contribute_the_identity_of_the_op(size: int, op: ReduceOp) -> None:
    """The last rank has joined: it submitted nothing, sends what leaves the result
    unchanged (zeros for Sum; not for Min, Max, Product) and completes nothing;
    Average still divides by the set's size. Fused and lone tensors."""
    joined = (size - 1,)

    def make(rank: int) -> list[Request]:
        return [allreduce("j0", contribution(rank, (4,), np.float32), op, postscale=2.0),
                allreduce("j1", contribution(rank, (3, 2), np.float32, 1), op, postscale=2.0),
                allreduce("j2", contribution(rank, (300,), np.float64, 2), op)]

    def steps(me: Ranks) -> None:
        mine = make(me.rank)
        requests: list[Optional[Request]] = [None] * 3 if me.rank in joined else list(mine)
        results = me.run(requests, [Response(r.desc, joined=joined) for r in make(0)])
        if me.rank in joined:
            assert results == {} and me.completed == []
            return
        for i, request in enumerate(mine):
            arrays = [None if r in joined else make(r)[i].array for r in range(size)]
            want = expected(arrays, request.array, op, postscale=2.0 if i < 2 else 1.0)
            assert results[request.desc.name].tolist() == want.tolist()
    # j2 alone, its own group; j0 and j1 fused
    on_ranks(size, steps, allreduce="mpi", direct_threshold=2000)


def test_a_rank_missing_some_tensors_of_a_group_sends_zeros_for_them() -> None:
    def make(rank: int) -> list[Request]:
        return [allreduce(f"p{i}", contribution(rank, (3,), np.float64, i)) for i in range(3)]

    def steps(me: Ranks) -> None:
        mine: list[Optional[Request]] = list(make(me.rank))
        if me.rank == 1:
            mine[1] = None
        results = me.run(mine, responses_for(make))
        for i, request in enumerate(mine):
            if request is None:
                continue
            arrays = [None if (r, i) == (1, 1) else make(r)[i].array for r in range(3)]
            assert results[request.desc.name].tolist() == \
                expected(arrays, request.array, ReduceOp.SUM).tolist()
    on_ranks(3, steps, allreduce="mpi")


# --- in-place results written back to non-contiguous targets -----------------------------

@pytest.mark.parametrize("size", [1, 2, 3])
def test_in_place_results_are_written_back_into_strided_targets(size: int) -> None:
    def target(rank: int, salt: int) -> np.ndarray:
        return contribution(rank, (4, 6), np.float64, salt)

    def make(rank: int) -> list[Request]:
        requests = []
        for i, (name, kind) in enumerate([("w0", Kind.ALLREDUCE), ("w1", Kind.ALLREDUCE),
                                          ("wb", Kind.BROADCAST)]):
            view = target(rank, i)[::2, 1::2]              # the user's strided tensor
            staged = np.ascontiguousarray(view)            # the API's staging copy
            fields = {"root": size - 1} if kind is Kind.BROADCAST else {}
            request = Request(desc(name, kind, staged, **fields), SET, staged, staged)
            request.writeback = view
            requests.append(request)
        return requests

    def steps(me: Ranks) -> None:
        requests = make(me.rank)
        views = [r.writeback for r in requests]
        results = me.run(requests, responses_for(make))
        for i in range(2):
            want = expected([target(r, i)[::2, 1::2] for r in range(size)], views[i],
                            ReduceOp.SUM)
            assert results[f"w{i}"] is views[i] and views[i].tolist() == want.tolist()
        assert results["wb"] is views[2]
        assert views[2].tolist() == target(size - 1, 2)[::2, 1::2].tolist()
    on_ranks(size, steps, allreduce="mpi")


@pytest.mark.parametrize("size", SIZES)
def test_each_reduction_its_tensors_and_bytes_are_counted_for_the_report(size: int) -> None:
    """HVDLITE_REPORT's gradients per step (the scaling forecast's input) at any size,
    one rank included: a fused group is one reduction, half types count widened."""
    def make(rank: int) -> list[Request]:
        return [allreduce(f"c{i}", contribution(rank, shape, np.float32, i), ReduceOp.SUM)
                for i, shape in enumerate(FUSED_SHAPES)] + [
            allreduce("half", contribution(rank, (3,), np.float16, 9), ReduceOp.SUM)]

    def steps(me: Ranks) -> None:
        me.run(make(me.rank), responses_for(make))
        assert me.executor.reductions.totals == (2, len(FUSED_SHAPES) + 1, 16 * 4 + 3 * 4)
        me.run(make(me.rank), responses_for(make))
        assert me.executor.reductions.totals == (4, 2 * len(FUSED_SHAPES) + 2, 2 * 76)
    on_ranks(size, steps)
