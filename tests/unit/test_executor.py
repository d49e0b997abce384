"""The executor without MPI processes: every rank of a set is a thread running its
own Executor over tests/unit/fake_comm.py, with the real MPI, ring and
parameter-server backends, at 1 to 4 ranks (found necessary by make mutate on
hvdlite/core/executor.py: each of its mutants cost an mpiexec run, hours for the
module). Responses and requests are built as the engine builds them: the
response carries the coordinator's (rank 0's) descriptor, a rank that has
joined has no request, and expected values come from rank and size."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Callable, Optional

import ml_dtypes
import numpy as np
import pytest

from hvdlite.backends import ps as ps_backend
from hvdlite.backends import ring as ring_backend
from hvdlite.backends.base import even_counts
from hvdlite.config import Config
from hvdlite.core import executor as executor_module
from hvdlite.core.executor import Executor
from hvdlite.core.requests import Descriptor, Kind, ReduceOp, Request, Response
from tests.unit.fake_comm import FAKE_MPI, ThreadComm, run_ranks

SET = 3                      # not set 0: the executor must use the id it is given
SIZES = [1, 2, 3, 4]
UFUNCS = {ReduceOp.SUM: np.add, ReduceOp.AVERAGE: np.add, ReduceOp.MIN: np.minimum,
          ReduceOp.MAX: np.maximum, ReduceOp.PRODUCT: np.multiply}
BF16 = np.dtype(ml_dtypes.bfloat16)
WIDE = {np.dtype(np.float16): np.dtype(np.float32), BF16: np.dtype(np.float32)}
Steps = Callable[[Executor, int, int], Any]


@pytest.fixture(autouse=True)
def _fake_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ring and the server wait on requests through ``MPI.Request.Waitall``."""
    monkeypatch.setattr(ring_backend, "MPI", FAKE_MPI)
    monkeypatch.setattr(ps_backend, "MPI", FAKE_MPI)


# --- building what the engine hands the executor ---------------------------------------

def contribution(rank: int, shape: tuple[int, ...], dtype: Any, salt: int = 0) -> np.ndarray:
    """Small signed integers (exact in any order of reduction), different per rank."""
    n = int(np.prod(shape, dtype=np.int64))
    values = (np.arange(n) * (rank + 3 + salt)) % 7 - 3 + rank
    return values.astype(dtype).reshape(shape)


def desc(name: str, kind: Kind, array: np.ndarray, **fields: Any) -> Descriptor:
    return Descriptor(name, kind, dtype=array.dtype.name if array.dtype != BF16 else "bfloat16",
                      shape=array.shape, **fields)


def allreduce(name: str, array: np.ndarray, op: ReduceOp = ReduceOp.SUM, *,
              inplace: bool = False, **fields: Any) -> Request:
    output = array if inplace else np.empty_like(array)
    return Request(desc(name, Kind.ALLREDUCE, array, op=int(op), **fields), SET, array, output)


def expected(arrays: list[Optional[np.ndarray]], like: np.ndarray, op: ReduceOp,
             prescale: float = 1.0, postscale: float = 1.0) -> np.ndarray:
    """What every rank must get: contributions widened, prescaled, reduced in rank
    order, divided (Average, by the set's size: joined ranks count) and postscaled."""
    wide = WIDE.get(like.dtype, like.dtype)
    parts = [np.zeros(like.shape, wide) if a is None else a.astype(wide) for a in arrays]
    for part in parts:
        if prescale != 1.0:
            np.multiply(part, prescale, out=part, casting="unsafe")
    total = parts[0].copy()
    for part in parts[1:]:
        UFUNCS[op](total, part, out=total)
    if op is ReduceOp.AVERAGE:
        np.true_divide(total, len(arrays), out=total, casting="unsafe")
    if postscale != 1.0:
        np.multiply(total, postscale, out=total, casting="unsafe")
    return total.astype(like.dtype)


class Ranks:
    """One Executor per rank, each recording what it completed and which backend
    calls it made."""

    def __init__(self, comm: ThreadComm, **settings: Any) -> None:
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.completed: list[tuple[Request, Any]] = []
        self.executor = Executor(Config.load({}, **settings),
                                 lambda request, result: self.completed.append((request, result)),
                                 lambda: None)
        self.executor.open_set(SET, comm)
        self.calls: list[tuple[str, str]] = []
        self._depth = 0
        for backend in self.executor.chain.every_backend():
            for kind in ("allreduce", "allreduce_from", "allgather", "broadcast", "alltoall",
                         "reducescatter"):
                if hasattr(backend, kind):
                    setattr(backend, kind, self._spy(backend.name, kind, getattr(backend, kind)))

    def _spy(self, name: str, kind: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if not self._depth:                 # the executor's calls, not a backend's own
                self.calls.append((name, kind))
            self._depth += 1
            try:
                return method(*args, **kwargs)
            finally:
                self._depth -= 1
        return call

    def run(self, requests: list[Optional[Request]], responses: list[Response],
            plan_key: Any = None) -> dict[str, Any]:
        """Run agreed responses with this rank's requests (None: not submitted here);
        the results completed, by name."""
        self.completed.clear()
        pending = {r.desc.name: r for r in requests if r is not None}
        self.executor.run(SET, responses, pending, plan_key)
        assert not self.executor.busy
        results = {r.desc.name: result for r, result in self.completed}
        assert len(results) == len(self.completed) == len(pending)   # each once, all of them
        assert all(r is pending[r.desc.name] for r, _ in self.completed)
        return results


def on_ranks(size: int, steps: Callable[[Ranks], Any], **settings: Any) -> list[Any]:
    return run_ranks(size, lambda comm: steps(Ranks(comm, **settings)))


def responses_for(make: Callable[[int], list[Request]], joined: tuple[int, ...] = ()
                  ) -> list[Response]:
    """The agreed responses: rank 0's descriptors (the coordinator's view)."""
    return [Response(r.desc, joined=joined) for r in make(0)]


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

@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.AVERAGE, ReduceOp.MAX])
@pytest.mark.parametrize("size", [2, 3, 4])
def test_joined_ranks_contribute_zeros(size: int, op: ReduceOp) -> None:
    """The last rank has joined: it submitted nothing, sends zeros and completes
    nothing; Average still divides by the set's size. Fused and lone tensors."""
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


# --- the other collectives ----------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.int16, BF16])
@pytest.mark.parametrize("size", SIZES)
def test_allgather_with_uneven_first_dimensions(size: int, dtype: Any) -> None:
    def array(rank: int) -> np.ndarray:
        return contribution(rank, (rank - 1, 2, 3), dtype) if rank % 2 else \
            contribution(rank, (rank + 2, 2, 3), dtype)

    def make(rank: int) -> Request:
        return Request(desc("g", Kind.ALLGATHER, array(rank)), SET, array(rank))

    def steps(me: Ranks) -> None:
        response = Response(make(0).desc, first_dims=tuple(array(r).shape[0]
                                                             for r in range(size)))
        results = me.run([make(me.rank)], [response])
        want = np.concatenate([array(r) for r in range(size)])
        assert results["g"].dtype == want.dtype and results["g"].shape == want.shape
        assert results["g"].astype(np.float64).tolist() == want.astype(np.float64).tolist()
        assert me.calls == [("mpi", "allgather")]
    on_ranks(size, steps)


@pytest.mark.parametrize("inplace", [True, False])
@pytest.mark.parametrize("size", SIZES)
def test_broadcast_from_a_root_that_is_not_rank_zero(size: int, inplace: bool) -> None:
    root = size - 1 if size < 3 else 1

    def make(rank: int) -> Request:
        array = contribution(rank, (5, 3), np.int32)
        output = array if inplace else array.copy()
        return Request(desc("b", Kind.BROADCAST, array, root=root), SET, array, output)

    def steps(me: Ranks) -> None:
        request = make(me.rank)
        output = request.output
        results = me.run([request], [Response(make(0).desc)])
        assert results["b"] is output
        assert output.tolist() == contribution(root, (5, 3), np.int32).tolist()
        assert me.calls == [("mpi", "broadcast")]
    on_ranks(size, steps, allreduce="ring")


@pytest.mark.parametrize("size", SIZES)
def test_alltoall_with_splits(size: int) -> None:
    """Rank r sends (r + j) % 3 rows of 2x2 to rank j."""
    def splits(rank: int) -> tuple[int, ...]:
        return tuple((rank + j) % 3 for j in range(size))

    def array(rank: int) -> np.ndarray:
        rows = sum(splits(rank))
        return (np.arange(rows * 4, dtype=np.float64).reshape(rows, 2, 2) + 100 * rank)

    def make(rank: int) -> Request:
        return Request(desc("a", Kind.ALLTOALL, array(rank), splits=splits(rank)), SET,
                       array(rank))

    def steps(me: Ranks) -> None:
        matrix = tuple(splits(r) for r in range(size))
        results = me.run([make(me.rank)], [Response(make(0).desc, split_matrix=matrix)])
        received, counts = results["a"]
        pieces = []
        for sender in range(size):
            start = sum(splits(sender)[: me.rank])
            pieces.append(array(sender)[start: start + splits(sender)[me.rank]])
        assert received.shape == (sum(p.shape[0] for p in pieces), 2, 2)
        assert received.tolist() == np.concatenate(pieces).tolist()
        assert counts.dtype == np.int32 and counts.tolist() == [s[me.rank] for s in matrix]
        assert me.calls == [("mpi", "alltoall")]
    on_ranks(size, steps)


@pytest.mark.parametrize("backend", ["mpi", "ring"])
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.AVERAGE, ReduceOp.MIN])
@pytest.mark.parametrize("dtype", [np.float64, np.float16, np.int32])
@pytest.mark.parametrize("size", SIZES)
def test_reducescatter_with_uneven_rows(size: int, dtype: Any, op: ReduceOp,
                                        backend: str) -> None:
    shape = (2 * size + 1, 3)

    def make(rank: int) -> Request:
        array = contribution(rank, shape, dtype) * 3 + 1
        return Request(desc("rs", Kind.REDUCESCATTER, array, op=int(op), prescale=0.5,
                            postscale=3.0), SET, array)

    def steps(me: Ranks) -> None:
        request = make(me.rank)
        before = request.array.copy()
        results = me.run([request], [Response(make(0).desc)])
        rows = even_counts(shape[0], size)
        start = sum(rows[: me.rank])
        want = expected([make(r).array for r in range(size)], before, op, 0.5, 3.0)
        got = results["rs"]
        assert got.dtype == before.dtype and got.shape == (rows[me.rank], 3)
        assert got.tolist() == want[start: start + rows[me.rank]].tolist()
        assert request.array.tolist() == before.tolist()
        assert me.calls == [(backend, "reducescatter")]
    on_ranks(size, steps, allreduce=backend)


def test_a_one_dimensional_reducescatter() -> None:
    def make(rank: int) -> Request:
        array = contribution(rank, (7,), np.int64)
        return Request(desc("r1", Kind.REDUCESCATTER, array), SET, array)

    def steps(me: Ranks) -> list:
        return me.run([make(me.rank)], [Response(make(0).desc)])["r1"].tolist()
    total = sum(make(r).array for r in range(3)).tolist()
    assert on_ranks(3, steps) == [total[0:3], total[3:5], total[5:7]]


@pytest.mark.parametrize("kind", [Kind.BARRIER, Kind.JOIN])
def test_barrier_and_join_complete_with_their_result(kind: Kind) -> None:
    def steps(me: Ranks) -> Any:
        request = Request(Descriptor("x", kind), SET)
        return me.run([request], [Response(request.desc, result=7 if kind is Kind.JOIN
                                           else None)])["x"]
    assert on_ranks(2, steps) == ([7, 7] if kind is Kind.JOIN else [None, None])


def test_allreduces_run_before_the_other_collectives_in_agreed_order() -> None:
    """Every rank runs the fused allreduces first, then the rest in agreed order."""
    def make(rank: int) -> list[Request]:
        array = np.full(2, float(rank))
        return [Request(desc("b", Kind.BROADCAST, array, root=0), SET, array, array.copy()),
                allreduce("s", array.copy()),
                Request(desc("g", Kind.ALLGATHER, array), SET, array)]

    def steps(me: Ranks) -> list:
        requests = make(me.rank)
        me.run(requests, [Response(r.desc, first_dims=(2, 2) if r.desc.name == "g" else None)
                          for r in make(0)])
        return [r.desc.name for r, _ in me.completed], me.calls
    for names, calls in on_ranks(2, steps, allreduce="mpi"):
        assert names == ["s", "b", "g"]
        assert calls == [("mpi", "allreduce_from"), ("mpi", "broadcast"), ("mpi", "allgather")]


# --- plans, the fusion buffer, reconfiguration ----------------------------------------------

@pytest.fixture
def plans(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many responses each fusion plan was computed for."""
    planned: list[int] = []
    plan_groups = executor_module.fusion.plan_groups

    def counting(responses: Any, *args: Any) -> Any:
        planned.append(len(responses))
        return plan_groups(responses, *args)
    monkeypatch.setattr(executor_module.fusion, "plan_groups", counting)
    return planned


def _group(rank: int, names: str = "abc") -> list[Request]:
    return [allreduce(n, np.full(3, float(rank + i))) for i, n in enumerate(names)]


def test_a_plan_key_reuses_its_plan_until_plans_are_forgotten(plans: list[int]) -> None:
    def steps(me: Ranks) -> None:
        def step(key: Any) -> None:
            mine = _group(me.rank)
            results = me.run(mine, responses_for(_group), key)
            assert [results[n].tolist() for n in "abc"] == [[1.0] * 3, [3.0] * 3, [5.0] * 3]
        step("k")
        step("k")               # memoized
        step(None)              # no key: planned every time
        step(None)
        me.executor.forget_plans()
        step("k")
        step(("k", 2))
        step(("k", 2))
    on_ranks(2, steps, allreduce="mpi")
    assert plans == [3] * 10      # 5 per rank: "k", None, None, "k" again, ("k", 2)


def test_the_plan_memo_forgets_its_oldest_plan_beyond_its_size(plans: list[int]) -> None:
    limit = executor_module._PLAN_MEMO_SIZE

    def steps(me: Ranks) -> int:
        for key in range(limit + 1):
            me.run(_group(me.rank), responses_for(_group), key)
        assert len(plans) == limit + 1
        me.run(_group(me.rank), responses_for(_group), 1)        # still there
        me.run(_group(me.rank), responses_for(_group), limit)    # the newest too
        assert len(plans) == limit + 1
        me.run(_group(me.rank), responses_for(_group), 0)        # evicted first
        return len(plans)
    assert limit == 64
    assert on_ranks(1, steps) == [limit + 2]


def test_forgetting_plans_empties_the_memo() -> None:
    def steps(me: Ranks) -> None:
        me.run(_group(me.rank), responses_for(_group), "k")
        fused = me.executor._plans["k"]
        assert [[r.name for r in group] for group in fused] == [["a", "b", "c"]]
        me.executor.forget_plans()
        assert me.executor._plans == {}
    on_ranks(1, steps)


def test_the_fusion_buffer_is_reused_across_runs() -> None:
    def steps(me: Ranks) -> None:
        me.run(_group(me.rank, "abcdef"), responses_for(lambda r: _group(r, "abcdef")))
        raw = me.executor._fusion._raw["cpu"]
        assert raw.nbytes == 6 * 3 * 8
        for step in range(3):
            names = "xy" if step % 2 else "pqr"
            results = me.run(_group(me.rank, names), responses_for(lambda r: _group(r, names)))
            assert [results[n].tolist() for n in names] == \
                [[float(2 * i + 1)] * 3 for i in range(len(names))]
            assert me.executor._fusion._raw["cpu"] is raw
    on_ranks(2, steps, allreduce="mpi")


def test_reconfigure_changes_the_backend_thresholds_and_plans(plans: list[int]) -> None:
    def steps(me: Ranks) -> None:
        me.run(_group(me.rank), responses_for(_group), "k")
        assert me.calls == [("mpi", "allreduce")]
        me.calls.clear()
        me.executor.reconfigure(me.executor.config.replace(allreduce="ring",
                                                           fusion_threshold=0))
        assert me.executor.config.allreduce == "ring"
        results = me.run(_group(me.rank), responses_for(_group), "k")
        assert [results[n].tolist() for n in "abc"] == [[1.0] * 3, [3.0] * 3, [5.0] * 3]
        assert me.calls == [("ring", "allreduce_from")] * 3     # one direct reduction each
    on_ranks(2, steps, allreduce="mpi")
    assert plans == [3, 3, 3, 3]


def test_a_closed_set_is_forgotten() -> None:
    def steps(me: Ranks) -> None:
        me.executor.close_set(SET)
        assert SET not in me.executor._geometry
        with pytest.raises(KeyError):
            me.executor.run(SET, responses_for(_group), {})
        me.executor.close_set(SET)                         # twice: nothing left to close
    on_ranks(1, steps)


# --- the timeline ---------------------------------------------------------------------------

class _Timeline:
    def __init__(self) -> None:
        self.spans: list[tuple[str, str, float, float]] = []

    def span(self, name: str, phase: str, start: float, end: float) -> None:
        self.spans.append((name, phase, start, end))


def test_the_timeline_gets_each_phase_from_agreement_on() -> None:
    def steps(comm: ThreadComm) -> list:
        timeline = _Timeline()
        run = Executor(Config.load({}, direct_threshold=64), lambda r, x: None, lambda: timeline)
        run.open_set(SET, comm)
        requests = _group(comm.Get_rank(), "ab") + [
            allreduce("big", np.ones(20)),
            Request(desc("g", Kind.ALLGATHER, np.ones(2)), SET, np.ones(2))]
        for request in requests:
            request.agreed_at = 5.0
        run.run(SET, [Response(r.desc, first_dims=(2, 2)) for r in requests],
                {r.desc.name: r for r in requests})
        return timeline.spans
    for spans in run_ranks(2, steps):
        by_name: dict[str, list] = {}
        for name, phase, start, end in spans:
            by_name.setdefault(name, []).append((phase, start, end))
        for name in ("a", "b", "big"):
            phases = by_name.pop(name)
            assert [p for p, _, _ in phases] == ["queue", "memcpy_in", "allreduce", "memcpy_out"]
            assert phases[0][1] == 5.0
            # each phase starts where the one before ended
            assert all(phases[i][2] == phases[i + 1][1] for i in range(3))
            assert all(start <= end for _, start, end in phases)
        ((phase, start, end), (kind, begin, _)) = by_name.pop("g")
        assert (phase, start, kind, begin) == ("queue", 5.0, "allgather", end)
        assert by_name == {}


def test_a_timeline_started_while_an_op_runs_starts_its_spans_at_agreement() -> None:
    """The timeline is looked up at every phase; one that appears after the first
    phase (started by the user meanwhile) still gets the op's span from agreement."""
    def steps(comm: ThreadComm) -> list:
        timeline = _Timeline()
        lookups = []

        def current() -> Optional[_Timeline]:
            lookups.append(1)
            return timeline if len(lookups) > 1 else None
        run = Executor(Config.load({}), lambda r, x: None, current)
        run.open_set(SET, comm)
        request = allreduce("late", np.ones(3), inplace=True)
        request.agreed_at = 5.0
        run.run(SET, [Response(request.desc)], {"late": request})
        return timeline.spans
    (spans,) = run_ranks(1, steps)
    assert [(phase, start) for _, phase, start, _ in spans][:1] == [("memcpy_in", 5.0)]
    assert [phase for _, phase, _, _ in spans] == ["memcpy_in", "allreduce", "memcpy_out"]


# --- what only a device's namespace sees ----------------------------------------------------

def test_in_place_on_a_device_compares_data_pointers() -> None:
    """CuPy arrays: the same memory is the same pointer (no kernel over the data)."""
    def at(ptr: int) -> Any:
        return SimpleNamespace(data=SimpleNamespace(ptr=ptr))
    device_xp = SimpleNamespace()
    base = 1 << 40                  # addresses are large ints: equal, never identical
    assert executor_module._in_place(device_xp, at(base + 200), at(base + 200))
    assert not executor_module._in_place(device_xp, at(base + 100), at(base + 200))
    assert not executor_module._in_place(device_xp, at(base + 200), at(base + 100))
    array = np.zeros(4)
    assert executor_module._in_place(np, array.reshape(-1), array)
    assert not executor_module._in_place(np, array.copy(), array)


def test_the_cpu_path_never_asks_the_device_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Host tensors take no device lookups (Python overhead on every op), whatever
    string object names the CPU (descriptors arrive unpickled, not interned)."""
    def refuse(device: str) -> Any:
        raise AssertionError(f"the device registry was asked about {device}")
    monkeypatch.setattr(executor_module, "described", refuse)
    cpu = "".join(["c", "pu"])

    def make(rank: int) -> list[Request]:
        array = np.full(3, float(rank))
        fused = [allreduce(f"f{i}", array + i, device=cpu) for i in range(2)]
        alone = allreduce("alone", np.full(5, float(rank)), device=cpu)
        broadcast = Request(desc("b", Kind.BROADCAST, array, root=1, device=cpu), SET,
                            array, array.copy())
        return fused + [alone, broadcast]

    def steps(me: Ranks) -> dict:
        return {name: result.tolist() for name, result in
                me.run(make(me.rank), responses_for(make)).items()}
    for results in on_ranks(2, steps, allreduce="mpi"):
        assert results == {"f0": [1.0] * 3, "f1": [3.0] * 3, "alone": [1.0] * 5,
                           "b": [1.0] * 3}
