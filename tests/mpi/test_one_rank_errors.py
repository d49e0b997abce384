"""An argument error on one rank only is an error on every rank, not a hang.

Protects against the other ranks waiting forever for a collective that the
offending rank refused locally: an invalid ``root_rank`` for broadcast, alltoall
``splits`` that do not add up to the first dimension, or (alltoall without
splits) a first dimension the set size does not divide. The offending rank raises
an HvdliteError (it may also be a ValueError); every other rank raises a
MismatchError naming the offending rank and the argument; then the next
collectives, unnamed ones of the same kind included, work everywhere.
"""
from __future__ import annotations

import re
from typing import Any, Callable, Optional

import numpy as np
import pytest

import hvdlite as hvd

torch = pytest.importorskip("torch")

import hvdlite.torch as hvdt  # noqa: E402

NAMING = ["named", "unnamed"]


def _bad_rank() -> int:
    return hvd.size() - 1


def _is_bad() -> bool:
    return hvd.rank() == _bad_rank()


def _name(naming: str, tag: str) -> Optional[str]:
    return f"one_rank.{tag}" if naming == "named" else None


def _names_rank(message: str, rank: int) -> bool:
    """'rank 3', 'ranks [3]', 'rank(s) [3]', 'rank=3' ..."""
    return re.search(rf"\brank(?:s|\(s\))?\W{{0,3}}{rank}\b", message) is not None


def _expect_error_everywhere(call: Callable[[], Any], argument: Optional[str]) -> None:
    """The offending rank: an HvdliteError. Every other rank: a MismatchError that
    names the offending rank (and ``argument``, when given)."""
    expected = hvd.HvdliteError if _is_bad() else hvd.MismatchError
    with pytest.raises(hvd.HvdliteError) as info:
        call()
    error, message = info.value, str(info.value)
    assert isinstance(error, expected), f"{type(error).__mro__}: {message}"
    if not _is_bad():
        assert _names_rank(message, _bad_rank()), f"the offending rank is not named: {message}"
        if argument is not None:
            assert argument in message, f"'{argument}' is not named: {message}"


def _allreduce_works(naming: str, tag: str) -> None:
    result = hvd.allreduce(np.full(2, float(hvd.rank())), op=hvd.Sum,
                           name=_name(naming, f"{tag}.after"))
    np.testing.assert_array_equal(result, np.full(2, float(sum(range(hvd.size())))))


def _broadcast_works(naming: str, tag: str) -> None:
    result = hvd.broadcast(np.full(3, 10.0 + hvd.rank()), root_rank=_bad_rank(),
                           name=_name(naming, f"{tag}.broadcast.after"))
    np.testing.assert_array_equal(result, np.full(3, 10.0 + _bad_rank()))


def _alltoall_works(naming: str, tag: str) -> None:
    size, rank = hvd.size(), hvd.rank()
    received, counts = hvd.alltoall(np.arange(size, dtype=np.int64) + 100 * rank,
                                    splits=[1] * size, name=_name(naming, f"{tag}.alltoall.after"))
    np.testing.assert_array_equal(received, np.array([100 * r + rank for r in range(size)]))
    np.testing.assert_array_equal(counts, np.ones(size))


# -- broadcast with an invalid root_rank on the last rank only -----------------------------
def _root() -> int:
    return hvd.size() + 5 if _is_bad() else 0


BROADCASTS: dict[str, Callable[[Optional[str]], Any]] = {
    "numpy.broadcast": lambda n: hvd.broadcast(np.ones(3), root_rank=_root(), name=n),
    "numpy.broadcast_": lambda n: hvd.broadcast_(np.ones(3), root_rank=_root(), name=n),
    "numpy.broadcast_async": lambda n: hvd.synchronize(
        hvd.broadcast_async(np.ones(3), root_rank=_root(), name=n)),
    "torch.broadcast": lambda n: hvdt.broadcast(torch.ones(3), root_rank=_root(), name=n),
    "torch.broadcast_": lambda n: hvdt.broadcast_(torch.ones(3), root_rank=_root(), name=n),
}


@pytest.mark.timeout(20)
@pytest.mark.parametrize("naming", NAMING)
@pytest.mark.parametrize("call", sorted(BROADCASTS))
def test_invalid_root_rank_on_one_rank_is_an_error_everywhere(call: str, naming: str) -> None:
    if hvd.size() < 2:
        pytest.skip("needs two ranks")
    tag = f"root.{call}"
    _expect_error_everywhere(lambda: BROADCASTS[call](_name(naming, tag)), "root_rank")
    _broadcast_works(naming, tag)
    _allreduce_works(naming, tag)


# -- alltoall whose splits do not add up, on the last rank only ----------------------------
def _splits() -> list[int]:
    size = hvd.size()
    return [2] + [1] * (size - 1) if _is_bad() else [1] * size     # bad: sums to size + 1


ALLTOALLS: dict[str, Callable[[Optional[str]], Any]] = {
    "numpy.alltoall": lambda n: hvd.alltoall(np.arange(hvd.size(), dtype=np.float64),
                                             splits=_splits(), name=n),
    "numpy.alltoall_async": lambda n: hvd.synchronize(hvd.alltoall_async(
        np.arange(hvd.size(), dtype=np.float64), splits=_splits(), name=n)),
    "torch.alltoall": lambda n: hvdt.alltoall(torch.arange(hvd.size(), dtype=torch.float64),
                                              splits=torch.tensor(_splits()), name=n),
}


@pytest.mark.timeout(20)
@pytest.mark.parametrize("naming", NAMING)
@pytest.mark.parametrize("call", sorted(ALLTOALLS))
def test_bad_alltoall_splits_on_one_rank_is_an_error_everywhere(call: str, naming: str) -> None:
    if hvd.size() < 2:
        pytest.skip("needs two ranks")
    tag = f"splits.{call}"
    _expect_error_everywhere(lambda: ALLTOALLS[call](_name(naming, tag)), "splits")
    _alltoall_works(naming, tag)
    _allreduce_works(naming, tag)


# -- alltoall without splits, first dimension indivisible on the last rank only -------------
def _rows() -> int:
    return hvd.size() + 1 if _is_bad() else hvd.size()


UNEVEN: dict[str, Callable[[Optional[str]], Any]] = {
    "numpy": lambda n: hvd.alltoall(np.zeros((_rows(), 2)), name=n),
    "torch": lambda n: hvdt.alltoall(torch.zeros(_rows(), 2), name=n),
}


@pytest.mark.timeout(20)
@pytest.mark.parametrize("naming", NAMING)
@pytest.mark.parametrize("lib", sorted(UNEVEN))
def test_alltoall_indivisible_on_one_rank_is_an_error_everywhere(lib: str, naming: str) -> None:
    if hvd.size() < 2:
        pytest.skip("needs two ranks")
    tag = f"uneven.{lib}"
    _expect_error_everywhere(lambda: UNEVEN[lib](_name(naming, tag)), None)
    _alltoall_works(naming, tag)
    _allreduce_works(naming, tag)
