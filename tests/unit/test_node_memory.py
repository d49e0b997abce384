"""The allreduce through the node's shared memory (hvdlite/transport/node_memory.py), with
threads as ranks (the in-process transport): every dtype and operator against NumPy's
reduction in rank order, sizes around the chunk, results bitwise equal on every rank,
segments not held once unmapped, and a peer that exits or never comes. Their set-up and
its fall-backs: test_node_memory_setup.py."""
from __future__ import annotations

import array
import dataclasses
import functools
import subprocess
import sys
import threading
import time
from typing import Any, Optional

import numpy as np
import pytest

from hvdlite.errors import PeerLostError
from hvdlite.failure.liveness import EXITED, RUNNING, identity, process_state
from hvdlite.reduce_op import ReduceOp
from hvdlite.transport import node_memory
from hvdlite.transport.node_memory import NodeMemory, open_node_memory
from tests.unit.fake_transport import ThreadTransport, run_transports
from tests.unit.test_node_memory_setup import segments_held

pytestmark = pytest.mark.timeout(120)

HALF = 96      # bytes: a few elements a chunk, so most sizes below span several chunks
SIZES = [0, 1, 2, 3, 5, 7, 11, 12, 13, 31, 47, 48, 49, 97, 127, 128, 129, 257, 1021]
DTYPES = [np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64,
          np.uint64, np.float16, np.float32, np.float64, np.complex64, np.complex128]
UFUNCS = {ReduceOp.SUM: np.add, ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum,
          ReduceOp.PRODUCT: np.multiply}


def _opened(t: ThreadTransport, **options: Any) -> Optional[NodeMemory]:
    return open_node_memory(t, half_bytes=HALF, **options)


def _part(rank: int, size: int, dtype: Any, seed: int = 0) -> np.ndarray:
    """Rank ``rank``'s values: mixed signs and magnitudes, NaN-free, the same each call."""
    rng = np.random.default_rng(1000 * seed + rank)
    values = rng.integers(-3, 4, size) * rng.choice([1.0, 0.5, 1e-3, 7.25], size)
    if np.dtype(dtype).kind == "c":
        return (values + 1j * values[::-1]).astype(dtype)
    if np.dtype(dtype).kind in "bui":
        return rng.integers(0, 5, size).astype(dtype) if np.dtype(dtype).kind != "b" \
            else rng.integers(0, 2, size).astype(bool)
    return values.astype(dtype)


def _reference(size: int, ranks: int, dtype: Any, op: ReduceOp, seed: int = 0) -> np.ndarray:
    """NumPy's reduction of every rank's part, in rank order (the order node_memory sums)."""
    parts = [_part(r, size, dtype, seed) for r in range(ranks)]
    with np.errstate(all="ignore"):
        return functools.reduce(UFUNCS[op], parts)


@pytest.mark.parametrize("ranks", [2, 3, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_every_dtype_and_operator_equals_numpys_reduction_in_rank_order(
        ranks: int, dtype: Any) -> None:
    ops = [ReduceOp.SUM, ReduceOp.PRODUCT] + \
        ([] if np.dtype(dtype).kind == "c" else [ReduceOp.MIN, ReduceOp.MAX])

    def steps(t: ThreadTransport) -> list[np.ndarray]:
        memory = _opened(t)
        assert memory is not None and memory.reduces(np.dtype(dtype), ReduceOp.SUM)
        out = []
        for op in ops:
            for size in SIZES:
                buf = _part(t.rank, size, dtype)
                with np.errstate(all="ignore"):
                    memory.allreduce(buf, op)
                out.append(buf)
        memory.close()
        return out

    results = run_transports(ranks, steps)
    cases = [(op, size) for op in ops for size in SIZES]
    for rank_results in results:
        for (op, size), got, want in zip(cases, rank_results, results[0]):
            assert got.tobytes() == want.tobytes(), (op, size)   # every rank copies the same bytes
    for (op, size), got in zip(cases, results[0]):
        want = _reference(size, ranks, dtype, op)
        if np.dtype(dtype).kind == "c" and op is ReduceOp.PRODUCT:
            # NumPy's complex product may fuse a multiply-add in one loop and not in another.
            np.testing.assert_allclose(got, want, rtol=1e-6)
        else:   # the same ufuncs in the same order: the same bits
            assert got.tobytes() == want.tobytes(), (op, size)
    assert segments_held() == []     # unmapped by every rank: nothing holds the memory any more


def test_calls_of_changing_sizes_and_shapes_in_a_row_stay_right() -> None:
    """The halves alternate across calls: a rank may write its next chunk while a slower
    one still copies the last one's result out of the other half."""
    sizes = [int(s) for s in np.random.default_rng(7).integers(0, 300, 60)]

    def steps(t: ThreadTransport) -> list[bytes]:
        memory = _opened(t)
        assert memory is not None
        out = []
        for call, size in enumerate(sizes):
            buf = _part(t.rank, size, np.float64, seed=call).reshape(-1, 1)
            memory.allreduce(buf, ReduceOp.SUM)
            out.append(buf.tobytes())
        return out

    for rank_results in run_transports(3, steps):
        for call, (size, got) in enumerate(zip(sizes, rank_results)):
            assert got == _reference(size, 3, np.float64, ReduceOp.SUM, seed=call).tobytes()


def test_a_peer_that_exited_fails_the_allreduce_naming_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 never arrives; its process is found gone within a check or two."""
    monkeypatch.setattr(node_memory, "CHECK_S", 0.05)

    def steps(t: ThreadTransport) -> Optional[str]:
        memory = _opened(t)
        assert memory is not None
        if t.rank == 1:
            return None
        memory._peers[1] = dataclasses.replace(memory._peers[1], pid=_exited_pid(), start=None)
        started = time.monotonic()
        with pytest.raises(PeerLostError) as error:
            memory.allreduce(np.ones(10), ReduceOp.SUM)
        assert time.monotonic() - started < 5
        return str(error.value)

    text = run_transports(2, steps)[0]
    assert text.startswith("rank 0: rank 1 (pid ") and "exited during an allreduce" in text


def test_a_peer_that_never_comes_times_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(node_memory, "CHECK_S", 0.05)

    def steps(t: ThreadTransport) -> Optional[str]:
        memory = _opened(t, timeout_s=0.3)
        assert memory is not None
        if t.rank != 0:
            return None
        with pytest.raises(PeerLostError) as error:
            memory.allreduce(np.ones(10), ReduceOp.SUM)
        return str(error.value)

    text = run_transports(3, steps)[0]
    assert "ranks [1, 2] did not reach an allreduce" in text and "within 0 s" in text


def _exited_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_real_peer_runs_then_is_exited_as_a_zombie_and_once_reaped() -> None:
    """What a waiting rank asks of a late peer (peers.process_state), on real
    processes: test_liveness covers the same on a fake /proc."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    peer = dataclasses.replace(identity(1), pid=child.pid, start=None)
    try:
        assert process_state(peer) == RUNNING
    finally:
        child.kill()
    deadline = time.monotonic() + 10
    while process_state(peer) != EXITED and time.monotonic() < deadline:
        time.sleep(0.01)                     # killed, not yet reaped: a zombie
    assert process_state(peer) == EXITED
    child.wait()
    assert process_state(peer) == EXITED


def test_only_numpys_numbers_and_the_elementwise_operators_are_taken() -> None:
    assert NodeMemory.reduces(np.dtype(np.float32), ReduceOp.SUM)
    assert not NodeMemory.reduces(np.dtype("V2"), ReduceOp.SUM)
    assert not NodeMemory.reduces(np.dtype(np.float32), ReduceOp.AVERAGE)


def test_negotiation_rounds_give_every_rank_the_and_of_every_vector() -> None:
    """Rounds in a row, ranks at different paces: each round's result is the AND of that
    round's vectors (the slots alternate; a rank two rounds ahead would overwrite one)."""
    rounds, words = 40, 3

    def bits(rank: int, number: int) -> list[int]:
        rng = np.random.default_rng(100 * number + rank)
        return [int(w) for w in rng.integers(0, 2**63, words, dtype=np.uint64)]

    def steps(t: ThreadTransport) -> list[list[int]]:
        memory = _opened(t)
        assert memory is not None
        vector = array.array("Q", bytes(8 * words))
        band = memory.band_round(vector)
        assert band is not None
        got = []
        for number in range(rounds):
            vector[:] = array.array("Q", bits(t.rank, number))
            pending = band.start()
            time.sleep(0.001 * ((t.rank + number) % 3))      # uneven paces
            while not pending.Test():
                time.sleep(0)
            got.append(list(vector))
        return got

    results = run_transports(3, steps)
    for number in range(rounds):
        expected = [functools.reduce(lambda a, b: a & b, column)
                    for column in zip(*(bits(r, number) for r in range(3)))]
        assert [rank_results[number] for rank_results in results] == [expected] * 3


def test_a_round_completes_only_once_every_rank_started_it() -> None:
    def steps(t: ThreadTransport) -> Optional[bool]:
        memory = _opened(t)
        assert memory is not None
        band = memory.band_round(array.array("Q", [2**64 - 1]))
        assert band is not None
        if t.rank == 0:
            pending = band.start()
            early = pending.Test()
            t.allgather("rank 0 tested")     # rank 1 starts only after this
            while not pending.Test():
                time.sleep(0)
            return early
        t.allgather("waiting")
        pending = band.start()
        while not pending.Test():
            time.sleep(0)
        return None

    assert run_transports(2, steps)[0] is False


def test_a_vector_longer_than_the_header_holds_takes_the_transports_round() -> None:
    def steps(t: ThreadTransport) -> tuple[bool, bool]:
        memory = _opened(t)
        assert memory is not None
        fits = array.array("Q", bytes(8 * node_memory.ROUND_WORDS))
        too_long = array.array("Q", bytes(8 * (node_memory.ROUND_WORDS + 1)))
        return memory.band_round(fits) is not None, memory.band_round(too_long) is None

    assert run_transports(2, steps) == [(True, True)] * 2


def test_a_round_waited_on_sleeps_until_the_last_rank_starts_it() -> None:
    """The engine waits on a round blocked (wait_for): asleep, taking no CPU while the
    last rank is late, and woken by that rank's start, not by the end of its limit
    (30 s: a wake-up takes microseconds, 15 s allows for a busy machine)."""
    late_started = threading.Event()

    def steps(t: ThreadTransport) -> Optional[tuple[bool, bool, bool, float, float]]:
        memory = _opened(t)
        assert memory is not None
        band = memory.band_round(array.array("Q", [2**64 - 1]))
        assert band is not None
        if t.rank == 1:
            t.allgather("late")
            time.sleep(0.3)                  # late: rank 0 is asleep on the round by now
            late_started.set()
            assert band.start().wait_for(30.0)
            return None
        pending = band.start()
        too_soon = pending.wait_for(0.05)
        t.allgather("waiting")
        started, cpu = time.monotonic(), time.thread_time()
        done = pending.wait_for(30.0)
        waited, cpu = time.monotonic() - started, time.thread_time() - cpu
        return too_soon, done, late_started.is_set(), waited, cpu

    too_soon, done, after_the_start, waited, cpu = run_transports(2, steps)[0]
    assert (too_soon, done, after_the_start) == (False, True, True)
    assert waited < 15.0 and cpu < 0.05


def test_a_rank_waiting_for_a_late_peer_in_an_allreduce_sleeps_until_it_arrives(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Past its yields a waiting rank sleeps on the late peer's counter, woken by the
    peer's arrival (with checks of its process 30 s apart, nothing else would: 15 s
    allows for a busy machine)."""
    monkeypatch.setattr(node_memory, "CHECK_S", 30.0)
    monkeypatch.setattr(node_memory, "YIELD_SPINS", 0)
    waiting = threading.Event()

    def steps(t: ThreadTransport) -> tuple[float, float]:
        memory = _opened(t)
        assert memory is not None
        buf = np.full(10, float(t.rank + 1))
        if t.rank == 1:
            assert waiting.wait(60)
            time.sleep(0.3)                  # late: rank 0 is asleep on it by now
        else:
            waiting.set()
        started, cpu = time.monotonic(), time.thread_time()
        memory.allreduce(buf, ReduceOp.SUM)
        assert (buf == 3.0).all()            # rank 1's part: it waited for the arrival
        return time.monotonic() - started, time.thread_time() - cpu

    waited, cpu = run_transports(2, steps)[0]
    assert waited < 15.0 and cpu < 0.05
