"""The coordinator's validation, without MPI: what must match across ranks for
each collective, error markers, join rules, and what a response carries."""
from __future__ import annotations

import pytest

from hvdlite.errors import ErrorKind
from hvdlite.negotiation.coordinator import Coordinator, build_response, find_marker, find_mismatch
from hvdlite.negotiation.requests import Descriptor, Kind, ReduceOp


def d(kind: Kind = Kind.ALLREDUCE, name: str = "t", **fields: object) -> Descriptor:
    fields.setdefault("dtype", "float32")
    fields.setdefault("shape", (4,))
    return Descriptor(name=name, kind=kind, **fields)  # type: ignore[arg-type]


# (kind, field, value on the last rank, label in the message): every compared field.
DIFFERENCES = [
    (Kind.ALLREDUCE, "dtype", "float64", "dtype"), (Kind.ALLREDUCE, "shape", (5,), "shape"),
    (Kind.ALLREDUCE, "op", int(ReduceOp.MAX), "op"),
    (Kind.ALLREDUCE, "prescale", 2.0, "prescale"), (Kind.ALLREDUCE, "postscale", 0.5, "postscale"),
    (Kind.ALLREDUCE, "device", "cuda:0", "device"),
    (Kind.REDUCESCATTER, "shape", (8,), "shape"), (Kind.REDUCESCATTER, "op", int(ReduceOp.MIN), "op"),
    (Kind.REDUCESCATTER, "prescale", 3.0, "prescale"),
    (Kind.REDUCESCATTER, "postscale", 3.0, "postscale"),
    (Kind.REDUCESCATTER, "dtype", "int8", "dtype"), (Kind.REDUCESCATTER, "device", "cuda:1", "device"),
    (Kind.BROADCAST, "root", 1, "root"), (Kind.BROADCAST, "shape", (2,), "shape"),
    (Kind.BROADCAST, "dtype", "int64", "dtype"), (Kind.BROADCAST, "device", "cuda:0", "device"),
    (Kind.ALLGATHER, "shape", (4, 2), "trailing_shape"), (Kind.ALLGATHER, "dtype", "int8", "dtype"),
    (Kind.ALLGATHER, "device", "cuda:0", "device"),
    (Kind.ALLTOALL, "shape", (4, 2), "trailing_shape"), (Kind.ALLTOALL, "dtype", "int8", "dtype"),
    (Kind.ALLTOALL, "device", "cuda:0", "device"),
    (Kind.ADD_PROCESS_SET, "ranks", (0, 2), "ranks"),
    (Kind.REMOVE_PROCESS_SET, "set_id", 3, "set_id"),
    (Kind.RECONFIGURE, "settings", (("allreduce", "ring"),), "settings"),
]


@pytest.mark.parametrize("kind,field,value,label", DIFFERENCES,
                         ids=[f"{k.value}-{f}" for k, f, _, _ in DIFFERENCES])
def test_every_compared_field_is_checked(kind: Kind, field: str, value: object, label: str) -> None:
    base = {"shape": (4, 3)} if kind in (Kind.ALLGATHER, Kind.ALLTOALL) else {}
    same = {r: d(kind, **base) for r in range(3)}
    assert find_mismatch(same) is None
    reports = dict(same)
    reports[2] = d(kind, **{**base, field: value})
    message = find_mismatch(reports)
    assert message is not None, (kind, field)
    assert f"Mismatched {label} for tensor 't'" in message
    assert "ranks [0, 1]" in message and "ranks [2]" in message and "Every rank must" in message
    response = build_response(reports, joined=[])
    assert response.error == message and response.error_kind is ErrorKind.MISMATCH


def test_fields_that_may_differ() -> None:
    """The first dimension of allgather/alltoall inputs, the GPU index, and fields
    a kind does not use."""
    gathers = {0: d(Kind.ALLGATHER, shape=(1, 3)), 1: d(Kind.ALLGATHER, shape=(6, 3))}
    assert find_mismatch(gathers) is None
    assert find_mismatch({0: d(device="cuda:0"), 1: d(device="cuda:3")}) is None
    assert find_mismatch({0: d(Kind.BROADCAST, op=1), 1: d(Kind.BROADCAST, op=2)}) is None
    assert find_mismatch({0: d(Kind.BARRIER, shape=(1,)), 1: d(Kind.BARRIER, shape=(2,))}) is None
    assert find_mismatch({0: d(), 1: d(root=1)}) is None     # root means nothing to allreduce


def test_op_is_named_and_kind_and_thread_come_first() -> None:
    message = find_mismatch({0: d(op=int(ReduceOp.SUM)), 1: d(op=int(ReduceOp.AVERAGE))})
    assert "op='SUM'" in message and "op='AVERAGE'" in message
    message = find_mismatch({0: d(), 1: d(Kind.BROADCAST, shape=(9,))})
    assert "Mismatched collective" in message and "'allreduce'" in message
    message = find_mismatch({0: d(thread="a"), 1: d(thread="b", shape=(9,))})
    assert "Mismatched submitting thread" in message and "name=" in message
    assert "Every rank must" not in message


def test_alltoall_needs_one_split_per_rank() -> None:
    good = {r: d(Kind.ALLTOALL, shape=(3, 2), splits=(1, 1, 1)) for r in range(3)}
    assert find_mismatch(good) is None
    bad = dict(good)
    bad[1] = d(Kind.ALLTOALL, shape=(3, 2), splits=(2, 1))
    message = find_mismatch(bad)
    assert message.startswith("alltoall 't': rank 1 gave 2 splits for a process set of 3")
    bad[1] = d(Kind.ALLTOALL, shape=(3, 2), splits=(1, 1, 1, 0))      # too many is wrong too
    assert find_mismatch(bad).startswith("alltoall 't': rank 1 gave 4 splits")
    assert find_mismatch({r: d(Kind.ALLTOALL, shape=(3, 2)) for r in range(3)}) is None


def test_error_markers_name_every_bad_rank_and_win_over_mismatches() -> None:
    reports = {0: d(), 1: d(error="root 9 out of range", shape=(9,)), 2: d(error="bad splits")}
    assert find_marker({0: d(), 1: d()}) is None
    message = find_marker(reports)
    assert message.startswith("allreduce 't' was called with invalid arguments on ranks [1, 2]")
    assert "rank 1: root 9 out of range; rank 2: bad splits" in message
    response = build_response(reports, joined=[])
    assert response.error == message and response.error_kind is ErrorKind.MISMATCH


def test_joined_ranks_allow_only_allreduce() -> None:
    response = build_response({0: d(Kind.BROADCAST, root=0)}, joined=[2, 1])
    assert response.error_kind is ErrorKind.JOIN
    assert "ranks [1, 2] are in join()" in response.error
    ok = build_response({0: d(), 1: d()}, joined=[3, 2])
    assert not ok.error and ok.error_kind is None and ok.joined == (2, 3)
    assert build_response({0: d(), 1: d()}, joined=[]).joined == ()


def test_responses_carry_what_differs_per_rank() -> None:
    gathered = build_response({0: d(Kind.ALLGATHER, shape=(2, 3)), 1: d(Kind.ALLGATHER, shape=(5, 3)),
                               2: d(Kind.ALLGATHER, shape=(0, 3))}, joined=[])
    assert gathered.first_dims == (2, 5, 0) and not gathered.error
    scalar = build_response({r: d(Kind.ALLGATHER, shape=()) for r in range(2)}, joined=[])
    assert scalar.first_dims == (1, 1)                 # a scalar gathers as one row
    explicit = {0: d(Kind.ALLTOALL, shape=(3, 2), splits=(1, 2)),
                1: d(Kind.ALLTOALL, shape=(1, 2), splits=(0, 1))}
    assert build_response(explicit, joined=[]).split_matrix == ((1, 2), (0, 1))
    even = {r: d(Kind.ALLTOALL, shape=(7, 2)) for r in range(3)}
    assert build_response(even, joined=[]).split_matrix == ((3, 2, 2),) * 3
    odd_share = {r: d(Kind.ALLTOALL, shape=(7, 2)) for r in range(2)}   # 7 // 2 is odd
    assert build_response(odd_share, joined=[]).split_matrix == ((4, 3),) * 2
    scalars = {r: d(Kind.ALLTOALL, shape=()) for r in range(2)}
    assert build_response(scalars, joined=[]).split_matrix == ((0, 0), (0, 0))
    plain = build_response({0: d(), 1: d()}, joined=[])
    assert plain.first_dims is None and plain.split_matrix is None and plain.name == "t"


def test_coordinator_orders_by_first_seen_and_forgets() -> None:
    coordinator = Coordinator(size=2)
    coordinator.ingest(0, [(d(name="late"), 0.0), (d(name="early"), 5.0)], now=100.0)
    coordinator.ingest(1, [(d(name="late"), 9.0)], now=100.0)   # seen 9 s ago on rank 1
    coordinator.ingest(1, [(d(name="early"), 0.0)], now=100.0)
    assert [r.name for r in coordinator.responses()] == ["late", "early"]
    coordinator.ingest(0, [(d(name="gone"), 0.0)], now=100.0)
    coordinator.forget(["gone", "never"])
    coordinator.ingest(1, [(d(name="gone"), 0.0)], now=100.0)
    assert coordinator.responses() == []          # rank 0's report was forgotten


def test_stalls_are_reported_once_and_joins_are_not_stalls() -> None:
    coordinator = Coordinator(size=3)
    coordinator.ingest(0, [(d(name="x"), 0.0), (Descriptor(name="join", kind=Kind.JOIN), 0.0)],
                       now=10.0)
    coordinator.ingest(1, [(d(name="x"), 0.0)], now=10.0)
    assert coordinator.stalled(now=12.0, after=3.0) == []
    assert coordinator.stalled(now=13.0, after=3.0) == [("x", [0, 1], [2], 3.0)]
    assert coordinator.mark_warned("x") and not coordinator.mark_warned("x")
    assert not coordinator.mark_warned("unknown")


def test_a_stall_counts_from_the_earliest_submission_a_rank_reported() -> None:
    # Rank 1's join comes first in the table: the tensors after it are still inspected.
    coordinator = Coordinator(size=3)
    coordinator.ingest(1, [(Descriptor(name="join", kind=Kind.JOIN), 0.5)], now=3.0)
    coordinator.ingest(0, [(d(name="x"), 1.0)], now=3.0)         # submitted at 2.0
    coordinator.ingest(2, [(d(name="x"), 3.0)], now=4.0)         # at 1.0: the earliest
    coordinator.ingest(0, [(d(name="y"), 1.0)], now=4.0)         # at 3.0
    assert coordinator.stalled(now=3.9, after=3.0) == []
    assert coordinator.stalled(now=5.5, after=2.5) == [("x", [0, 2], [1], 4.5),
                                                       ("y", [0], [1, 2], 2.5)]


def test_join_completes_when_every_rank_joined_and_names_the_last() -> None:
    join = Descriptor(name="join", kind=Kind.JOIN)
    coordinator = Coordinator(size=3)
    coordinator.ingest(2, [(join, 0.0)])
    coordinator.ingest(1, [(join, 0.0)])
    assert coordinator.responses() == [] and coordinator.joined() == [1, 2]
    coordinator.ingest(0, [(join, 0.0)])
    (done,) = coordinator.responses()
    assert done.result == 0 and done.joined == (0, 1, 2) and coordinator.joined() == []
    # Joined in the same round: the highest rank is named last.
    coordinator.ingest(0, [(join, 0.0)])
    coordinator.ingest(1, [(join, 0.0)])
    coordinator.ingest(2, [(join, 0.0)])
    (done,) = coordinator.responses()
    assert done.result == 2


def test_join_completes_beyond_small_integer_sizes() -> None:
    """Counts are compared by value: CPython caches only small ints, so an identity
    check would hold only for sets of up to 256 ranks."""
    join = Descriptor(name="join", kind=Kind.JOIN)
    coordinator = Coordinator(size=300)
    for rank in range(300):
        coordinator.ingest(rank, [(join, 0.0)])
    (done,) = coordinator.responses()
    assert done.result == 299 and len(done.joined) == 300


# -- while a rank is joined -------------------------------------------------------------------
JOIN = Descriptor(name="join", kind=Kind.JOIN)


@pytest.mark.parametrize("kind", [Kind.ALLGATHER, Kind.BROADCAST, Kind.ALLTOALL,
                                  Kind.REDUCESCATTER, Kind.BARRIER])
def test_while_a_rank_is_joined_anything_but_allreduce_fails_for_whoever_reported_it(
        kind: Kind) -> None:
    """Failed at once, without waiting for the other ranks' reports: they may submit
    it under another name (unnamed ops counted differently), and would wait forever."""
    coordinator = Coordinator(size=4)
    coordinator.ingest(0, [(JOIN, 0.0)])
    coordinator.ingest(2, [(d(kind, name="x.2"), 0.0)])
    (failed,) = coordinator.responses()
    assert failed.name == "x.2" and failed.error_kind is ErrorKind.JOIN
    assert "ranks [0] are in join()" in failed.error
    coordinator.ingest(1, [(d(kind, name="x.2"), 0.0)])      # the same name, later
    coordinator.ingest(3, [(d(kind, name="x.3"), 0.0)])
    assert [(r.name, r.error_kind) for r in coordinator.responses()] == [
        ("x.2", ErrorKind.JOIN), ("x.3", ErrorKind.JOIN)]


def test_a_partial_report_is_a_join_error_not_a_mismatch() -> None:
    """Splits are checked against the set's size, which two reports of four are not."""
    coordinator = Coordinator(size=4)
    coordinator.ingest(0, [(JOIN, 0.0)])
    for rank in (1, 2):
        coordinator.ingest(rank, [(d(Kind.ALLTOALL, shape=(8, 2), splits=(2, 2, 2, 2)), 0.0)])
    (failed,) = coordinator.responses()
    assert failed.error_kind is ErrorKind.JOIN


def test_a_rank_in_join_on_another_set_contributes_to_its_allreduces() -> None:
    """join() goes to the global set; on another set the rank's report says it is in
    join(), for that round: its allreduce runs without it, anything else fails, and
    messages name global ranks."""
    coordinator = Coordinator(size=2, members=(3, 5))
    coordinator.ingest(0, [], joined=True)
    coordinator.ingest(1, [(d(name="sum"), 0.0), (d(Kind.ALLGATHER, name="gather"), 0.0)])
    reduced, gathered = coordinator.responses()
    assert reduced.name == "sum" and not reduced.error and reduced.joined == (0,)
    assert gathered.error_kind is ErrorKind.JOIN and "ranks [3] are in join()" in gathered.error
    coordinator.ingest(0, [])                                  # left join(): waited for again
    coordinator.ingest(1, [(d(name="next"), 0.0)])
    assert coordinator.responses() == []
    coordinator.ingest(0, [(d(name="next"), 0.0)])
    (agreed,) = coordinator.responses()
    assert agreed.name == "next" and agreed.joined == ()


def test_a_joined_rank_is_not_missing_from_a_stalled_allreduce() -> None:
    coordinator = Coordinator(size=3)
    coordinator.ingest(0, [(JOIN, 0.0)])
    coordinator.ingest(1, [(d(name="x"), 0.0)], now=10.0)
    assert coordinator.responses() == []
    assert coordinator.stalled(now=20.0, after=5.0) == [("x", [1], [2], 10.0)]


def test_clear_forgets_reports_and_joins() -> None:
    coordinator = Coordinator(size=2)
    coordinator.ingest(0, [(JOIN, 0.0), (d(name="x"), 0.0)])
    coordinator.clear()
    assert coordinator.joined() == [] and coordinator.stalled(now=1e9, after=0.0) == []
    coordinator.ingest(1, [(d(name="x"), 0.0)])
    assert coordinator.responses() == []                       # rank 0's report is gone
