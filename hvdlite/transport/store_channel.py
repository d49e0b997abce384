"""The liveness channel of a transport whose world shares a key-value store (torch's
rendezvous store, under torchrun): pings and verdicts travel out of band, so a peer
stuck in a collective still gets them (hvdlite/failure/liveness.py)."""
from __future__ import annotations

from typing import Any, Sequence


class StoreChannel:
    """Pings and verdicts as counters and values in the store: ``ping/<to>/<from>``
    counts pings, ``told/<to>/<from>`` verdicts, ``verdict/<to>/<from>`` holds the last.
    Each drain reads 2(P-1) counters; it runs only while a round is overdue."""

    def __init__(self, store: Any, prefix: str, me: int, size: int) -> None:
        self._store, self._prefix, self._me = store, prefix, me
        self._others = [r for r in range(size) if r != me]
        self._pings = dict.fromkeys(self._others, 0)
        self._told = dict.fromkeys(self._others, 0)

    def _key(self, what: str, to: int, source: int) -> str:
        return f"{self._prefix}/{what}/{to}/{source}"

    def ping(self, ranks: Sequence[int]) -> None:
        for rank in ranks:
            self._store.add(self._key("ping", rank, self._me), 1)

    def drain(self) -> tuple[set[int], list[tuple[int, str]]]:
        heard: set[int] = set()
        verdicts: list[tuple[int, str]] = []
        for peer in self._others:
            pings = self._store.add(self._key("ping", self._me, peer), 0)
            if pings != self._pings[peer]:
                self._pings[peer] = pings
                heard.add(peer)
            told = self._store.add(self._key("told", self._me, peer), 0)
            if told != self._told[peer]:
                self._told[peer] = told
                heard.add(peer)
                text = self._store.get(self._key("verdict", self._me, peer))
                verdicts.append((peer, text.decode("utf-8", "replace")))
        return heard, verdicts

    def tell(self, ranks: Sequence[int], text: str) -> None:
        for rank in ranks:
            self._store.set(self._key("verdict", rank, self._me), text)
            self._store.add(self._key("told", rank, self._me), 1)   # after: the text is there
