"""The executor's other collectives, plans, buffers and timeline without MPI
processes (tests/unit/executor_ranks.py): allgather, broadcast, alltoall and
reducescatter at 1 to 4 ranks, the order of a run, the plan memo, the fusion
buffer's reuse, reconfiguration, closed sets, timeline spans, and what only a
device's namespace sees."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Optional

import numpy as np
import pytest

from hvdlite.backends.base import even_counts
from hvdlite.config import Config
from hvdlite.engine import executor as executor_module
from hvdlite.engine import packing
from hvdlite.engine.executor import Executor
from hvdlite.negotiation.requests import Descriptor, Kind, ReduceOp, Request, Response
from hvdlite.transport.mpi_transport import MpiTransport
from tests.unit.executor_ranks import (BF16, SET, SIZES, Ranks, allreduce, contribution, desc,
                                       expected, fake_requests, on_ranks, responses_for)
from tests.unit.fake_comm import ThreadComm, run_ranks


@pytest.fixture(autouse=True)
def _fake_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_requests(monkeypatch)

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
        raw = me.executor.fusion._raw["cpu"]
        assert raw.nbytes == 6 * 3 * 8
        for step in range(3):
            names = "xy" if step % 2 else "pqr"
            results = me.run(_group(me.rank, names), responses_for(lambda r: _group(r, names)))
            assert [results[n].tolist() for n in names] == \
                [[float(2 * i + 1)] * 3 for i in range(len(names))]
            assert me.executor.fusion._raw["cpu"] is raw
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

    def span(self, request: Request, phase: str, start: float, end: float) -> None:
        self.spans.append((request.desc.name, phase, start, end))


def test_the_timeline_gets_each_phase_from_agreement_on() -> None:
    def steps(comm: ThreadComm) -> list:
        timeline = _Timeline()
        run = Executor(Config.load({}, direct_threshold=64), lambda r, x: None, lambda: timeline)
        run.open_set(SET, MpiTransport(comm))
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
            assert [p for p, _, _ in phases] == ["QUEUE", "MEMCPY_IN_FUSION_BUFFER",
                                                 "MPI_ALLREDUCE", "MEMCPY_OUT_FUSION_BUFFER"]
            assert phases[0][1] == 5.0
            # each phase starts where the one before ended
            assert all(phases[i][2] == phases[i + 1][1] for i in range(3))
            assert all(start <= end for _, start, end in phases)
        ((phase, start, end), (kind, begin, _)) = by_name.pop("g")
        assert (phase, start, kind, begin) == ("QUEUE", 5.0, "MPI_ALLGATHER", end)
        assert by_name == {}


@pytest.mark.parametrize("kind", [Kind.BARRIER, Kind.JOIN])
def test_what_agreement_alone_completes_has_no_backend_activity(kind: Kind) -> None:
    def steps(comm: ThreadComm) -> list:
        timeline = _Timeline()
        run = Executor(Config.load({}), lambda r, x: None, lambda: timeline)
        run.open_set(SET, MpiTransport(comm))
        request = Request(Descriptor("x", kind), SET)
        request.agreed_at = 5.0
        run.run(SET, [Response(request.desc)], {"x": request})
        return timeline.spans
    for spans in run_ranks(2, steps):
        assert [(name, phase, start) for name, phase, start, _ in spans] == [("x", "QUEUE", 5.0)]


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
        run.open_set(SET, MpiTransport(comm))
        request = allreduce("late", np.ones(3), inplace=True)
        request.agreed_at = 5.0
        run.run(SET, [Response(request.desc)], {"late": request})
        return timeline.spans
    (spans,) = run_ranks(1, steps)
    assert [(phase, start) for _, phase, start, _ in spans][:1] == [
        ("MEMCPY_IN_FUSION_BUFFER", 5.0)]
    assert [phase for _, phase, _, _ in spans] == ["MEMCPY_IN_FUSION_BUFFER", "MPI_ALLREDUCE",
                                                   "MEMCPY_OUT_FUSION_BUFFER"]


# --- what only a device's namespace sees ----------------------------------------------------

def test_a_lone_tensor_whose_input_is_its_output_by_another_view_is_not_copied() -> None:
    """An adapter may hand the same memory over as two array objects: the lone tensor is
    still reduced in place, never passed to MPI as its own source (aliased buffers)."""
    memory = np.arange(6, dtype=np.float32)
    request = allreduce("v", memory.reshape(2, 3), inplace=True)
    request.array = memory.reshape(2, 3)          # another view of the same memory
    assert request.array is not request.output
    buf = request.output.reshape(-1)
    assert packing.pack_one(np, request, buf, 1.0, out_of_place=True) is None
    assert packing.pack_one(np, request, buf, 2.0, out_of_place=True) is None
    np.testing.assert_array_equal(memory, np.arange(6) * 2.0)   # scaled once, in place


def test_in_place_on_a_device_compares_data_pointers() -> None:
    """CuPy arrays: the same memory is the same pointer (no kernel over the data)."""
    def at(ptr: int) -> Any:
        return SimpleNamespace(data=SimpleNamespace(ptr=ptr))
    device_xp = SimpleNamespace()
    base = 1 << 40                  # addresses are large ints: equal, never identical
    assert packing.is_in_place(device_xp, at(base + 200), at(base + 200))
    assert not packing.is_in_place(device_xp, at(base + 100), at(base + 200))
    assert not packing.is_in_place(device_xp, at(base + 200), at(base + 100))
    array = np.zeros(4)
    assert packing.is_in_place(np, array.reshape(-1), array)
    assert not packing.is_in_place(np, array.copy(), array)


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
