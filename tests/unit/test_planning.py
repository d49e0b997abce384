"""Pure logic, no MPI: negotiation, the response cache, fusion plans, ring schedules."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from hvdlite.backends import even_counts, segment_bounds, widened_dtype
from hvdlite.backends.ring import allgather_schedule, chunk_bounds, reduce_scatter_schedule
from hvdlite.engine import fusion
from hvdlite.errors import ErrorKind
from hvdlite.negotiation.cache import ResponseCache
from hvdlite.negotiation.coordinator import Coordinator, find_mismatch
from hvdlite.negotiation.requests import Descriptor, Kind, ReduceOp, Response


def desc(name: str, shape: tuple[int, ...] = (4,), dtype: str = "float32", **kw: object) -> Descriptor:
    return Descriptor(name=name, kind=kw.pop("kind", Kind.ALLREDUCE), dtype=dtype, shape=shape,
                      **kw)  # type: ignore[arg-type]


def test_mismatch_message_names_tensor_ranks_and_field() -> None:
    message = find_mismatch({0: desc("w"), 1: desc("w"), 2: desc("w", (5,))})
    assert "'w'" in message and "shape" in message and "ranks [2]" in message
    assert "ranks [0, 1]" in message


def test_allgather_first_dimension_may_differ() -> None:
    reports = {0: desc("g", (1, 3), kind=Kind.ALLGATHER), 1: desc("g", (4, 3), kind=Kind.ALLGATHER)}
    assert find_mismatch(reports) is None
    reports[1] = desc("g", (4, 2), kind=Kind.ALLGATHER)
    assert "trailing_shape" in find_mismatch(reports)


def test_coordinator_waits_for_every_rank_then_responds_in_order() -> None:
    coordinator = Coordinator(size=2)
    coordinator.ingest(0, [(desc("a"), 0.0), (desc("b"), 0.0)], now=10.0)
    assert coordinator.responses() == []
    coordinator.ingest(1, [(desc("b"), 0.0)], now=10.5)
    assert [r.name for r in coordinator.responses()] == ["b"]
    coordinator.ingest(1, [(desc("a"), 0.0)], now=11.0)
    assert [r.name for r in coordinator.responses()] == ["a"]


def test_coordinator_stall_report_and_join() -> None:
    coordinator = Coordinator(size=3)
    coordinator.ingest(0, [(desc("x"), 2.0)], now=100.0)
    stalled = coordinator.stalled(now=100.0, after=1.5)
    assert stalled == [("x", [0], [1, 2], 2.0)]
    join = Descriptor(name="join", kind=Kind.JOIN)
    coordinator.ingest(1, [(join, 0.0)], now=100.0)
    coordinator.ingest(2, [(desc("x"), 0.0)], now=100.0)
    (response,) = coordinator.responses()
    assert response.name == "x" and response.joined == (1,)   # rank 1 contributes zeros
    coordinator.ingest(2, [(join, 0.0)], now=100.0)
    assert coordinator.responses() == []
    coordinator.ingest(0, [(join, 0.0)], now=101.0)
    (done,) = coordinator.responses()
    assert done.desc.kind is Kind.JOIN and done.result == 0   # rank 0 joined last


def test_joined_ranks_only_allow_allreduce() -> None:
    coordinator = Coordinator(size=2)
    coordinator.ingest(0, [(Descriptor(name="join", kind=Kind.JOIN), 0.0)])
    coordinator.ingest(1, [(desc("g", (2,), kind=Kind.ALLGATHER), 0.0)])
    (response,) = coordinator.responses()
    assert response.error_kind is ErrorKind.JOIN and "join()" in response.error


def test_cache_bits_identical_order_and_eviction() -> None:
    cache = ResponseCache(capacity=3)
    for name in "abcd":
        cache.insert(Response(desc=desc(name)), desc(name))
    assert cache.lookup(desc("a")) is None          # least recently used, evicted
    assert cache.lookup(desc("d")) == 0             # took a's freed bit
    assert cache.lookup(desc("b", (5,))) is None    # same name, other shape: miss
    vector = np.zeros(1 + cache.words, dtype=np.uint64)
    cache.set_bits([cache.lookup(desc(n)) for n in "bcd"], vector[1:])
    assert ResponseCache.bits_of(vector[1:]) == [0, 1, 2]
    assert [cache.response(b).name for b in ResponseCache.bits_of(vector[1:])] == ["d", "b", "c"]


def test_bits_beyond_one_word() -> None:
    vector = np.zeros(3, dtype=np.uint64)
    ResponseCache.set_bits([0, 63, 64, 130], vector)
    assert ResponseCache.bits_of(vector) == [0, 63, 64, 130]


def _allreduce(name: str, count: int, dtype: str = "float32", op: ReduceOp = ReduceOp.SUM) -> Response:
    return Response(desc=desc(name, (count,), dtype, op=int(op)))


def test_fusion_groups_by_dtype_and_op_within_threshold() -> None:
    responses = [_allreduce("a", 10), _allreduce("b", 10, "float64"), _allreduce("c", 10),
                 _allreduce("d", 10, op=ReduceOp.MAX), _allreduce("e", 20)]
    groups = fusion.plan_groups(responses, threshold=100)
    assert [[r.name for r in g] for g in groups] == [["a", "c"], ["b"], ["d"], ["e"]]
    groups = fusion.plan_groups(responses, threshold=1 << 20)
    assert [[r.name for r in g] for g in groups] == [["a", "c", "e"], ["b"], ["d"]]


def test_half_types_reduce_in_float32() -> None:
    assert widened_dtype(np.dtype(np.float16)) == np.float32
    assert widened_dtype(np.dtype(ml_dtypes.bfloat16)) == np.float32
    assert widened_dtype(np.dtype(np.int8)) == np.int8
    halves = [_allreduce("h", 10, "float16"), _allreduce("h2", 10, "float16")]
    assert len(fusion.plan_groups(halves, threshold=80)) == 1    # 2 x 10 float32 = 80 bytes
    assert len(fusion.plan_groups(halves, threshold=79)) == 2


def test_fusion_buffer_is_persistent() -> None:
    buffers = fusion.FusionBuffers(lambda device: np)
    first = buffers.view("cpu", np.dtype(np.float32), 100)
    again = buffers.view("cpu", np.dtype(np.float64), 50)
    assert np.shares_memory(first, again)


@pytest.mark.parametrize("size", [1, 2, 3, 4, 7])
def test_ring_schedule_visits_each_segment_once(size: int) -> None:
    for rank in range(size):
        received = [recv for _, recv in reduce_scatter_schedule(rank, size)]
        assert len(set(received)) == size - 1 and rank in received or size == 1
        gathered = [recv for _, recv in allgather_schedule(rank, size)]
        assert sorted(gathered + [rank]) == list(range(size))
    for step in range(size - 1):   # what rank r sends, its right neighbour receives
        for rank in range(size):
            sent = reduce_scatter_schedule(rank, size)[step][0]
            assert reduce_scatter_schedule((rank + 1) % size, size)[step][1] == sent
            sent = allgather_schedule(rank, size)[step][0]
            assert allgather_schedule((rank + 1) % size, size)[step][1] == sent


def test_ring_reduce_scatter_ends_owning_own_segment() -> None:
    """Simulate the schedule: after P-1 steps rank r's segment r holds every rank's data."""
    size = 4
    contributions = {r: [{r} for _ in range(size)] for r in range(size)}
    for step in range(size - 1):
        sends = {r: contributions[r][reduce_scatter_schedule(r, size)[step][0]] for r in range(size)}
        for r in range(size):
            segment = reduce_scatter_schedule(r, size)[step][1]
            contributions[r][segment] = contributions[r][segment] | sends[(r - 1) % size]
    assert all(contributions[r][r] == set(range(size)) for r in range(size))


def test_chunks_and_segments() -> None:
    assert chunk_bounds(10, 25, 6) == [(10, 16), (16, 22), (22, 25)]
    assert chunk_bounds(5, 5, 4) == []
    assert even_counts(10, 4) == [3, 3, 2, 2]
    assert segment_bounds([3, 0, 2]) == [(0, 3), (3, 3), (3, 5)]


def test_slurm_view_is_trusted_only_for_this_very_rank() -> None:
    from hvdlite.transport.topology import slurm_view
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_NODEID": "1", "SLURM_LOCALID": "1"}
    assert slurm_view(3, 4, env) == (1, 1)
    assert slurm_view(2, 4, env) is None          # PROCID is not this rank (mpirun in sbatch)
    assert slurm_view(3, 8, env) is None          # the step has another size
    assert slurm_view(0, 1, {}) is None
