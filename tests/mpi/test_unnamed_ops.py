"""Unnamed collectives never pair up wrongly: never a wrong number, never a hang.

Protects the automatic names of unnamed ops in two situations where one
per-process counter per kind makes ranks disagree about which op is which:

* two threads per rank issuing unnamed allreduces: every call returns exactly
  its own sum, or raises an HvdliteError telling the user to name the ops;
* overlapping process sets ([0, 1] and [1, 2]): rank 1 issues unnamed ops on
  both sets, its peers only on one, and all of them complete with the right
  values; unnamed ops on the global set still line up afterwards.

Run at -n 2 and -n 4, and at -n 3 (the process-set tests need three ranks and
skip below that).
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable

import numpy as np
import pytest

import hvdlite as hvd

THREADS, STEPS = 2, 200
BASE = 2048                 # > every code below: a sum decodes to one code per rank


def _code(thread: int, step: int) -> int:
    return 1000 * thread + step + 1


def _value(thread: int, step: int, rank: int) -> int:
    """Rank r's contribution in base-BASE digit r: any other pairing changes the sum."""
    return _code(thread, step) * BASE ** rank


def _expected(thread: int, step: int) -> int:
    return sum(_value(thread, step, r) for r in range(hvd.size()))


@dataclasses.dataclass
class _Outcomes:
    correct: int = 0
    told_to_name: int = 0
    wrong: list = dataclasses.field(default_factory=list)
    other_errors: list = dataclasses.field(default_factory=list)


def _worker(thread: int, outcomes: _Outcomes, start: threading.Barrier) -> None:
    start.wait()
    for step in range(STEPS):
        value = _value(thread, step, hvd.rank())
        try:
            got = hvd.allreduce(np.full(3, value, dtype=np.int64), op=hvd.Sum)
        except hvd.HvdliteError as exc:
            if "name" in str(exc):
                outcomes.told_to_name += 1
            else:
                outcomes.other_errors.append(f"step {step}: {exc!r}")
            continue
        except BaseException as exc:  # noqa: BLE001 - recorded, reported by the main thread
            outcomes.other_errors.append(f"step {step}: {exc!r}")
            continue
        if np.array_equal(got, np.full(3, _expected(thread, step), dtype=np.int64)):
            outcomes.correct += 1
        else:
            outcomes.wrong.append((step, int(got[0]), _expected(thread, step)))


def _global_ops_line_up() -> None:
    """Unnamed and named collectives on the global set, on the main thread."""
    size = hvd.size()
    np.testing.assert_array_equal(hvd.allreduce(np.ones(2), op=hvd.Sum), np.full(2, float(size)))
    np.testing.assert_array_equal(hvd.allgather(np.array([hvd.rank()])), np.arange(size))
    np.testing.assert_array_equal(hvd.allreduce(np.ones(2), op=hvd.Sum, name="unnamed.after"),
                                  np.full(2, float(size)))


@pytest.mark.timeout(40)
def test_unnamed_allreduces_from_two_threads_are_never_wrong() -> None:
    if hvd.size() > 5:
        pytest.skip("the encoding of contributions needs int64 headroom: at most 5 ranks")
    start = threading.Barrier(THREADS)
    outcomes = [_Outcomes() for _ in range(THREADS)]
    threads = [threading.Thread(target=_worker, args=(t, outcomes[t], start), daemon=True)
               for t in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    _global_ops_line_up()
    wrong = [(t, w) for t in range(THREADS) for w in outcomes[t].wrong]
    others = [e for o in outcomes for e in o.other_errors]
    summary = [dataclasses.astuple(o)[:2] for o in outcomes]
    assert not wrong, f"{len(wrong)} wrong sums (thread, (step, got, expected)): {wrong[:5]}; " \
                      f"(correct, told to name) per thread: {summary}"
    assert not others, f"errors that do not tell to name the ops: {others[:5]}"


# -- overlapping process sets ----------------------------------------------------------------
def _with_overlapping_sets(body: Callable[[hvd.ProcessSet, hvd.ProcessSet], Any]) -> Any:
    """Register [0, 1] and [1, 2] on every rank (same order), run ``body``, remove them."""
    if hvd.size() < 3:
        pytest.skip("needs three ranks: sets [0, 1] and [1, 2] overlap on rank 1")
    first = hvd.add_process_set(hvd.ProcessSet([0, 1]))
    second = hvd.add_process_set(hvd.ProcessSet([1, 2]))
    try:
        return body(first, second)
    finally:
        hvd.remove_process_set(first)
        hvd.remove_process_set(second)


def _sum_on(process_set: hvd.ProcessSet, value: Callable[[int], float]) -> float:
    return float(sum(value(r) for r in process_set.ranks))


@pytest.mark.timeout(30)
def test_unnamed_allreduces_on_overlapping_sets() -> None:
    def body(a: hvd.ProcessSet, b: hvd.ProcessSet) -> list:
        checks = []
        rank = hvd.rank()
        first, second, third = (lambda r: 10.0 + r), (lambda r: 100.0 * (r + 1)), (
            lambda r: 1000.0 + r)
        if rank in a.ranks:          # ranks 0 and 1: two unnamed allreduces on [0, 1]
            checks.append((hvd.allreduce(np.array([first(rank)]), op=hvd.Sum, process_set=a),
                           _sum_on(a, first)))
            checks.append((hvd.allreduce(np.array([second(rank)]), op=hvd.Sum, process_set=a),
                           _sum_on(a, second)))
        if rank in b.ranks:          # ranks 1 and 2: one on [1, 2] (rank 1: after its two)
            checks.append((hvd.allreduce(np.array([third(rank)]), op=hvd.Sum, process_set=b),
                           _sum_on(b, third)))
        return checks

    checks = _with_overlapping_sets(body)
    _global_ops_line_up()
    for got, expected in checks:
        np.testing.assert_array_equal(got, [expected])


@pytest.mark.timeout(30)
def test_unnamed_async_allgathers_interleaved_on_overlapping_sets() -> None:
    def body(a: hvd.ProcessSet, b: hvd.ProcessSet) -> list:
        rank = hvd.rank()
        pending: list[tuple[int, np.ndarray]] = []

        def gather(process_set: hvd.ProcessSet, tag: int) -> None:
            handle = hvd.allgather_async(np.array([[rank, tag]]), process_set=process_set)
            expected = np.array([[r, tag] for r in process_set.ranks])
            pending.append((handle, expected))

        # rank 1 interleaves: [0, 1], then [1, 2], then [0, 1] again, all in flight at once
        if rank in a.ranks:
            gather(a, 1)
        if rank in b.ranks:
            gather(b, 2)
        if rank in a.ranks:
            gather(a, 3)
        return [(hvd.synchronize(h), expected) for h, expected in pending]

    checks = _with_overlapping_sets(body)
    _global_ops_line_up()
    for got, expected in checks:
        np.testing.assert_array_equal(got, expected)


@pytest.mark.timeout(30)
def test_unnamed_allgather_object_on_overlapping_sets() -> None:
    def body(a: hvd.ProcessSet, b: hvd.ProcessSet) -> list:
        rank = hvd.rank()
        checks: list[tuple[Any, Any]] = []
        for label, process_set in (("first", a), ("second", b)):
            if rank in process_set.ranks:
                got = hvd.allgather_object({"rank": rank, "set": label}, process_set=process_set)
                checks.append((got, [{"rank": r, "set": label} for r in process_set.ranks]))
        return checks

    checks = _with_overlapping_sets(body)
    objects = hvd.allgather_object(hvd.rank())     # unnamed, global: still lines up
    assert objects == list(range(hvd.size()))
    _global_ops_line_up()
    for got, expected in checks:
        assert got == expected
