"""Shared by the deadlock tests: a short stall check time, the uneven shards, and
what every rank must see (the test files differ in the framework that trains).

The data are uneven on purpose: rank 0 holds 64 samples and every other rank 96, in
batches of 16, so rank 0 reaches the end of its epoch (a metric average) while the
others still wait on the next step's gradients. Each rank records the error its
training raised; the checks run after one more collective, so a rank whose check
fails never leaves the others waiting.
"""
from __future__ import annotations

import logging
import re
from typing import Any, Iterator, Optional

import numpy as np
import pytest

import hvdlite as hvd
from hvdlite.api.control import reconfigure

STALL_CHECK_S = 1.0     # the deadlock is an error after half of it
BATCH = 16


def samples(rank: int) -> int:
    return 64 if rank == 0 else 96


def shard(rank: int, features: int = 5) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(rank)
    n = samples(rank)
    return (rng.normal(size=(n, features)).astype("float32"),
            rng.normal(size=(n, 1)).astype("float32"))


class Warnings(logging.Handler):
    """hvdlite's log records while installed."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def short_stall_check() -> Iterator[Warnings]:
    """HVDLITE_STALL_CHECK_TIME of one second (negotiated: every rank switches at the
    same point), and hvdlite's log records meanwhile."""
    records = Warnings()
    logging.getLogger("hvdlite").addHandler(records)
    reconfigure(stall_check_time=STALL_CHECK_S)
    try:
        yield records
    finally:
        reconfigure(stall_check_time=60.0)
        logging.getLogger("hvdlite").removeHandler(records)


def recovered(tag: str) -> np.ndarray:
    """A collective after the deadlock: it must work on every rank."""
    return hvd.allreduce(np.ones(2), op=hvd.Sum, name=f"deadlock.recovered.{tag}")


def deadlock_text(error: Optional[BaseException]) -> str:
    """The message of a DeadlockError, as raised in eager code or carried by the error
    TensorFlow's runtime raises for it when a traced function fails (its text starts
    with the hvdlite class name; see hvdlite/tensorflow/errors.py)."""
    assert error is not None, "training ended without an error"
    if isinstance(error, hvd.DeadlockError):
        assert isinstance(error, hvd.MismatchError)
        return str(error)
    text = str(error)
    assert "DeadlockError: rank " in text, f"{type(error).__name__}: {text[:2000]}"
    return text[text.index("DeadlockError: rank ") + len("DeadlockError: "):]


def check_deadlock(error: Optional[BaseException], after: np.ndarray,
                   waits: dict[str, str]) -> str:
    """Every rank raised the deadlock, naming each rank's pending tensor (``waits``:
    on rank 0, and the start of the name on the others: a gradient bucket's name
    lists its parameters; any collective, as an eager tape first checks its
    variables with an allgather), the missing ranks and the likely cause; the next
    collective worked."""
    text = deadlock_text(error)
    assert text.startswith(f"rank {hvd.rank()}: Deadlock: "), text
    # How long every rank had been blocked when rank 0 decided: half the stall check
    # time, and not much more: a few rounds, which a busy machine can make slow.
    blocked = float(re.match(r"rank \d+: Deadlock: for ([\d.]+) s", text).group(1))
    assert STALL_CHECK_S / 2 <= blocked < STALL_CHECK_S / 2 + 3, text
    size = hvd.size()
    assert f"rank 0 waits on allreduce '{waits['rank 0']}' (not submitted by ranks " \
           f"{list(range(1, size))})" in text, text
    for rank in range(1, size):
        assert re.search(rf"rank {rank} waits on \w+ '{re.escape(waits['others'])}"
                         r"[^']*' \(not submitted by ranks \[0\]\)", text), text
    for cause in ("different numbers of batches", "steps_per_epoch", "ElasticSampler",
                  "hvd.join()"):
        assert cause in text, text
    np.testing.assert_array_equal(after, np.full(2, float(size)))
    return text


def first_error(run: Any) -> Optional[BaseException]:
    """Run training; the exception it raised (None if it ended normally)."""
    try:
        run()
    except Exception as error:      # the deadlock, possibly as TensorFlow's error
        return error
    return None
