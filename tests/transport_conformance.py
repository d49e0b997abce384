"""What every transport (hvdlite/transport/base.py) must do, as checks that run on
any implementation: each ``check_*`` is collective over the transport it is given
and asserts what that rank sees.

Run in one process over the fake (tests/unit/test_transport_conformance.py, threads
as ranks, at sizes 1 to 4) and under mpiexec over MPI
(tests/mpi/test_transport_conformance.py, at -n 2 and -n 4). Broken fakes that each
of these checks must catch: tests/unit/test_transport_conformance.py.
"""
from __future__ import annotations

import array
import time
from typing import Any, Callable, Optional

import numpy as np

from hvdlite.errors import HvdliteError
from hvdlite.reduce_op import ReduceOp
from hvdlite.transport.base import Pending, Transport

# How long a check waits for pings and verdicts to arrive (they do in milliseconds).
DEADLINE_S = 10.0


def _wait_all(pending: list[Pending]) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not all(p.Test() for p in pending):
        assert time.monotonic() < deadline, "a pending operation never completed"
        time.sleep(1e-4)


class Waiter:
    """The engine's part in an awaited collective: it must be handed every step."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, pending: Any) -> None:
        self.calls += 1
        _wait_all(list(pending))


def check_identity(t: Transport) -> None:
    assert isinstance(t, Transport)
    assert isinstance(t.name, str) and t.name
    assert 0 <= t.rank < t.size
    assert isinstance(t.failures, tuple) and all(issubclass(f, BaseException)
                                                 for f in t.failures)
    assert t.allgather(t.rank) == list(range(t.size))


def check_small_objects(t: Transport) -> None:
    mine = {"rank": t.rank, "list": [t.rank] * 3}
    everyone = t.allgather(mine)
    assert everyone == [{"rank": r, "list": [r] * 3} for r in range(t.size)]
    everyone[t.rank]["list"].append("changed")           # a copy, not the sender's object
    assert mine["list"] == [t.rank] * 3
    for root in range(t.size):
        got = t.bcast(("from", t.rank) if t.rank == root else None, root=root)
        assert got == ("from", root)


def check_awaited_gather_and_bcast(t: Transport) -> None:
    waiter = Waiter()
    gathered = t.gather_awaited({"report of": t.rank}, waiter)
    if t.rank == 0:
        assert gathered == [{"report of": r} for r in range(t.size)]
    else:
        assert gathered is None
    verdict = t.bcast_awaited(["verdict", t.size] if t.rank == 0 else "ignored", waiter)
    assert verdict == ["verdict", t.size]
    # Every step went through the engine's wait (where it looks for lost peers).
    assert waiter.calls >= 2


def _vector(t: Transport, words: int, salt: int) -> list[int]:
    """Rank-specific words whose AND over ranks is known: bit r of word w is clear on
    rank r only; a few high bits are set everywhere."""
    full = (1 << 64) - 1
    return [(full ^ (1 << ((t.rank + w + salt) % 64))) for w in range(words)]


def check_band_round(t: Transport) -> None:
    words = 3
    vector = array.array("Q", bytes(8 * words))
    band = t.band_round(vector)
    for salt in range(3):             # one round made once, started again and again
        vector[:] = array.array("Q", _vector(t, words, salt))
        _wait_all([band.start()])
        full = (1 << 64) - 1
        want = []
        for w in range(words):
            cleared = {(r + w + salt) % 64 for r in range(t.size)}
            want.append(full ^ sum(1 << b for b in cleared))
        assert vector.tolist() == want, f"round {salt}: {vector.tolist()} != {want}"
    band.free()


def check_split(t: Transport) -> None:
    # Two colors, numbered by a key that reverses the parent's order.
    sub = t.split(t.rank % 2, key=-t.rank)
    assert sub is not None
    same = [r for r in range(t.size) if r % 2 == t.rank % 2]
    expected = sorted(same, key=lambda r: -r)
    assert sub.size == len(same) and sub.rank == expected.index(t.rank)
    assert sub.allgather(t.rank) == expected
    sub.free()
    # A rank that passes no color takes part and gets nothing.
    left_out = t.split(None if t.rank == 0 else 7, key=t.rank)
    if t.rank == 0:
        assert left_out is None
    else:
        assert left_out is not None and left_out.size == t.size - 1
        assert left_out.rank == t.rank - 1
        left_out.free()


def check_dup_is_a_context_of_its_own(t: Transport) -> None:
    twin = t.dup()
    assert (twin.rank, twin.size) == (t.rank, t.size)
    vector = array.array("Q", [t.rank + 1])
    band = twin.band_round(vector)
    started = band.start()
    # A collective on the parent while the twin's round is open: they must not match.
    assert t.allgather(("parent", t.rank)) == [("parent", r) for r in range(t.size)]
    _wait_all([started])
    expected = 0xFFFFFFFFFFFFFFFF
    for r in range(t.size):
        expected &= r + 1
    assert vector.tolist() == [expected]
    band.free()
    twin.free()


def check_split_node(t: Transport) -> None:
    node = t.split_node(key=t.rank)
    members = node.allgather(t.rank)
    assert t.rank in members and members == sorted(members)
    assert node.size == len(members) and members.index(t.rank) == node.rank
    # Every rank of a node sees the same members: the groups partition the world.
    views = t.allgather(members)
    for r, view in enumerate(views):
        assert r in view and all(views[m] == view for m in view)
    node.free()


def _until(deadline: float, done: Callable[[], bool]) -> bool:
    while time.monotonic() < deadline:
        if done():
            return True
        time.sleep(1e-3)
    return done()


def check_liveness_channel(t: Transport) -> None:
    channel = t.liveness_channel()
    others = [r for r in range(t.size) if r != t.rank]
    heard: set[int] = set()
    verdicts: list[tuple[int, str]] = []

    def drain() -> None:
        got, told = channel.drain()
        heard.update(got)
        verdicts.extend(told)
    channel.ping(others)
    deadline = time.monotonic() + DEADLINE_S
    assert _until(deadline, lambda: drain() or heard >= set(others)), \
        f"rank {t.rank} heard {sorted(heard)} of {others}"
    t.allgather(None)                    # every rank heard its pings: now the verdicts
    if t.rank == 0:
        channel.tell(others, "rank 9 (pid 1 on nowhere) exited")
    else:
        assert _until(deadline, lambda: drain() or bool(verdicts)), \
            f"rank {t.rank}: no verdict from rank 0"
        assert verdicts == [(0, "rank 9 (pid 1 on nowhere) exited")]
    # Pings and verdicts never reach the transport's collectives.
    assert t.allgather(t.rank) == list(range(t.size))
    t.allgather(None)
    drain()                               # nothing left over for a later check
    assert all(source in others for source in heard)


_NUMPY_OPS = {ReduceOp.SUM: np.add, ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum,
              ReduceOp.PRODUCT: np.multiply}


def _contribution(rank: int, dtype: Any) -> np.ndarray:
    return (np.array([1, 2, 3, 4, 5], dtype=dtype) * (rank + 1)
            - np.array([0, 3, 0, 3, 0], dtype=dtype) * rank)


def check_allreduce_array(t: Transport) -> None:
    for dtype in (np.float64, np.int32):
        for op, ufunc in _NUMPY_OPS.items():
            buf = _contribution(t.rank, dtype)
            t.allreduce_array(buf, op)
            want = _contribution(0, dtype)
            for r in range(1, t.size):
                want = ufunc(want, _contribution(r, dtype))
            np.testing.assert_array_equal(buf, want, err_msg=f"{op.name} of {dtype.__name__}")
    try:
        t.allreduce_array(np.ones(2), ReduceOp.AVERAGE)
    except HvdliteError as error:
        assert f"rank {t.rank}" in str(error) and "AVERAGE" in str(error)
    else:
        raise AssertionError("AVERAGE was accepted: it is the backends' work")


def check_broadcast_array(t: Transport) -> None:
    for root in range(t.size):
        buf = np.full(4, float(t.rank), dtype=np.float32)
        t.broadcast_array(buf, root)
        np.testing.assert_array_equal(buf, np.full(4, float(root), dtype=np.float32))


def check_allgather_array(t: Transport) -> None:
    counts = [r + 1 for r in range(t.size)]             # uneven on purpose
    send = np.full(counts[t.rank], t.rank * 10, dtype=np.int64)
    recv = np.full(sum(counts), -1, dtype=np.int64)
    t.allgather_array(send, recv, counts)
    want = np.concatenate([np.full(c, r * 10, dtype=np.int64) for r, c in enumerate(counts)])
    np.testing.assert_array_equal(recv, want)


def alltoall_counts(size: int, rank: int) -> list[int]:
    """What rank ``rank`` sends each rank: 0, 1 and primes, never the same twice in a row."""
    sizes = (0, 1, 2, 3, 5, 7, 11, 13)
    return [sizes[(rank * 3 + to) % len(sizes)] for to in range(size)]


def alltoall_part(sender: int, to: int, count: int, dtype: Any) -> np.ndarray:
    return (np.arange(count) % 7 + sender * 10 + to).astype(dtype)


def check_alltoall_array(t: Transport) -> None:
    for dtype in (np.uint8, np.int32, np.float64):
        counts = alltoall_counts(t.size, t.rank)
        send = np.concatenate([alltoall_part(t.rank, to, c, dtype)
                               for to, c in enumerate(counts)])
        recv_counts = [alltoall_counts(t.size, r)[t.rank] for r in range(t.size)]
        recv = np.full(sum(recv_counts), 99, dtype=dtype)
        t.alltoall_array(send, counts, recv, recv_counts)
        want = np.concatenate([alltoall_part(r, t.rank, c, dtype)
                               for r, c in enumerate(recv_counts)])
        np.testing.assert_array_equal(recv, want, err_msg=f"alltoall of {dtype.__name__}")


CHECKS: list[Callable[[Transport], None]] = [
    check_identity, check_small_objects, check_awaited_gather_and_bcast, check_band_round,
    check_split, check_dup_is_a_context_of_its_own, check_split_node, check_liveness_channel,
    check_allreduce_array, check_broadcast_array, check_allgather_array,
    check_alltoall_array]


def by_name(name: str) -> Optional[Callable[[Transport], None]]:
    return next((c for c in CHECKS if c.__name__ == name), None)
