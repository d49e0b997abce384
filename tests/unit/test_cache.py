"""The negotiation cache's bit vector size, its capacity edge cases, and the bit a
request remembers until the cache changes (found by make mutate on negotiation/cache.py)."""
from __future__ import annotations

import numpy as np
import pytest

from hvdlite.negotiation.cache import ResponseCache
from hvdlite.negotiation.requests import Descriptor, Kind, Request, Response


def _desc(name: str) -> Descriptor:
    return Descriptor(name=name, kind=Kind.ALLREDUCE, dtype="float32", shape=(4,))


@pytest.mark.parametrize("capacity, words", [(0, 0), (1, 1), (63, 1), (64, 1), (65, 2),
                                             (128, 2), (129, 3), (1024, 16)])
def test_one_uint64_word_per_64_bits(capacity: int, words: int) -> None:
    assert ResponseCache(capacity).words == words


def test_capacity_zero_caches_nothing_and_one_caches_one() -> None:
    off = ResponseCache(0)
    off.insert(Response(desc=_desc("a")), _desc("a"))
    assert len(off) == 0 and off.lookup(_desc("a")) is None
    one = ResponseCache(1)
    one.insert(Response(desc=_desc("a")), _desc("a"))
    assert len(one) == 1 and one.lookup(_desc("a")) == 0
    one.insert(Response(desc=_desc("b")), _desc("b"))     # evicts a, reuses its bit
    assert one.lookup(_desc("a")) is None and one.lookup(_desc("b")) == 0


def test_a_request_remembers_its_bit_until_the_cache_changes() -> None:
    cache = ResponseCache(2)
    calls = []
    lookup = cache.lookup
    cache.lookup = lambda desc: calls.append(desc.name) or lookup(desc)  # type: ignore[method-assign]
    request = Request(_desc("a"), 0)
    assert cache.bit_for(request) is None and calls == ["a"]      # unknown: looked up
    assert cache.bit_for(request) is None and calls == ["a"]      # memoized
    cache.insert(Response(desc=_desc("a")), _desc("a"))
    assert cache.bit_for(request) == 0 and calls == ["a", "a"]    # the cache changed
    assert cache.bit_for(request) == 0 and calls == ["a", "a"]
    cache.insert(Response(desc=_desc("b")), _desc("b"))
    cache.insert(Response(desc=_desc("c")), _desc("c"))           # evicts a
    assert cache.bit_for(request) is None and calls[-1] == "a"


def test_a_negative_capacity_is_refused() -> None:
    for capacity in (-1, -2):
        with pytest.raises(ValueError, match="capacity must be >= 0"):
            ResponseCache(capacity)


@pytest.mark.parametrize("shape", [(2,), (8,), (4, 1)])
def test_a_descriptor_that_differs_either_way_finds_no_bit(shape: tuple[int, ...]) -> None:
    # Descriptors are tuples: a mismatch must be found whichever of the two sorts first.
    cache = ResponseCache(4)
    cache.insert(Response(desc=_desc("a")), _desc("a"))
    assert cache.lookup(_desc("a")) == 0
    assert cache.lookup(_desc("a")._replace(shape=shape)) is None


def test_set_bits_ors_a_bit_named_twice() -> None:
    vector = np.zeros(2, dtype=np.uint64)
    ResponseCache.set_bits([5, 5, 70, 70, 70], vector)
    assert vector.tolist() == [1 << 5, 1 << 6]
    assert ResponseCache.bits_of(vector) == [5, 70]
