"""Response cache: the steady-state fast path of negotiation.

Every rank inserts the same agreed responses in the same order and evicts the
same least-recently-executed entries, so a bit index names the same response
on every rank. A round then needs only a bitwise-AND allreduce of "which cached
responses do I have a matching request for"; bits set on every rank are agreed.
"""
from __future__ import annotations

import collections
from typing import Any, Optional

from hvdlite.negotiation.requests import Descriptor, Request, Response


class ResponseCache:
    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError("cache capacity must be >= 0")
        self.capacity = capacity
        # name -> (bit, response, this rank's descriptor); ordered oldest use first.
        self._entries: "collections.OrderedDict[str, tuple[int, Response, Descriptor]]" = (
            collections.OrderedDict())
        self._by_bit: dict[int, str] = {}
        self.version = 0   # bumped whenever a bit's meaning changes

    @property
    def words(self) -> int:
        """uint64 words needed for the bit vector."""
        return (self.capacity + 63) // 64

    def __len__(self) -> int:
        return len(self._entries)

    def bit_for(self, request: "Request") -> Optional[int]:
        """lookup() memoized on the request until the cache next changes."""
        if request.bit_version != self.version:
            request.bit = self.lookup(request.desc)
            request.bit_version = self.version
        return request.bit

    def lookup(self, desc: Descriptor) -> Optional[int]:
        """The bit of a cached response matching this rank's descriptor exactly."""
        entry = self._entries.get(desc.name)
        if entry is None or entry[2] != desc:
            return None
        return entry[0]

    def response(self, bit: int) -> Response:
        return self._entries[self._by_bit[bit]][1]

    def insert(self, response: Response, local: Descriptor) -> None:
        if self.capacity == 0:
            return
        old = self._entries.pop(response.name, None)
        if old is not None:
            del self._by_bit[old[0]]
        elif len(self._entries) >= self.capacity:
            _, (bit, _, _) = self._entries.popitem(last=False)
            del self._by_bit[bit]
        bit = self._free_bit()
        self.version += 1
        self._entries[response.name] = (bit, response, local)
        self._by_bit[bit] = response.name

    def touch(self, name: str) -> None:
        """Mark a response as just executed (identically on every rank)."""
        if name in self._entries:
            self._entries.move_to_end(name)

    def _free_bit(self) -> int:
        used = self._by_bit
        return next(b for b in range(self.capacity) if b not in used)

    @staticmethod
    def set_bits(bits: list[int], vector: Any, first_word: int = 0) -> None:
        """OR the given bits into a vector of 64-bit words, from ``first_word`` on
        (Python ints: numpy scalars are slow)."""
        words: dict[int, int] = {}
        for bit in bits:
            words[bit >> 6] = words.get(bit >> 6, 0) | (1 << (bit & 63))
        for index, word in words.items():
            vector[first_word + index] = word

    @staticmethod
    def bits_of(vector: Any, first_word: int = 0) -> list[int]:
        """Indices of the set bits from ``first_word`` on, ascending (the agreed
        execution order). Plain Python over ``tolist()``: the vector is a few words,
        and after an idle spell each NumPy call costs microseconds of cold code."""
        bits = []
        for index, word in enumerate(vector.tolist()[first_word:]):
            base = index << 6
            while word:
                low = word & -word
                bits.append(base + low.bit_length() - 1)
                word ^= low
        return bits
