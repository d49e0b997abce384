"""Agreeing on the process sets ``hvdlite.init(process_sets=...)`` registers.

Every rank sends what it was asked for; each decides from the same gathered
requests, so either every rank registers the same sets in the same order or every
rank raises the same UsageError, and none is registered before all agree. No MPI
here: the API checks a running engine's requests with it too.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence, Union

from hvdlite.errors import UsageError
from hvdlite.transport.base import Transport

# What a rank asks for: each set's global ranks (ascending), or the text of the error
# its own arguments gave (reported on every rank).
RequestedSets = Union[Sequence[tuple[int, ...]], str]


def agree_on_sets(requested: Sequence[RequestedSets], world_size: int,
                  registered: Mapping[int, tuple[int, ...]], me: int) -> list[tuple[int, ...]]:
    """The sets to register, from every rank's request (in rank order), or the one
    UsageError every rank raises: each rank decides from the same gathered requests.
    Registering nothing before every rank agrees leaves nothing half-registered."""
    where = f"rank {me}: hvdlite.init(process_sets=...)"
    failed = [f"rank {r}: {text}" for r, text in enumerate(requested) if isinstance(text, str)]
    if failed:
        raise UsageError(f"{where} was refused on some ranks: {'; '.join(failed)}")
    first = [tuple(ranks) for ranks in requested[0]]
    differ = [r for r, sets in enumerate(requested) if [tuple(s) for s in sets] != first]
    if differ:
        other = [list(s) for s in requested[differ[0]]]
        raise UsageError(
            f"{where} got different process sets on different ranks: rank 0 asked for "
            f"{[list(s) for s in first]}, rank {differ[0]} for {other} (ranks that differ "
            f"from rank 0: {differ}); pass the same sets, in the same order, on every rank")
    seen = {ranks: f"process set {set_id}, already registered"
            for set_id, ranks in registered.items()}
    seen[tuple(range(world_size))] = "the global process set (every rank), always registered"
    for index, ranks in enumerate(first):
        if not ranks or ranks[0] < 0 or ranks[-1] >= world_size:
            raise UsageError(f"{where}: entry {index}, ranks {list(ranks)}, names ranks "
                             f"outside 0..{world_size - 1}")
        if ranks in seen:
            raise UsageError(f"{where}: entry {index}, ranks {list(ranks)}, duplicates "
                             f"{seen[ranks]}; pass each set once")
        seen[ranks] = f"entry {index}"
    return first


def register_agreed_sets(registry: Any, world: Transport, requested: RequestedSets) -> None:
    """At engine setup, collective over ``world``: gather every rank's request, and
    register the global set (id 0) and then the agreed sets, in order, on every rank."""
    size, rank = world.size, world.rank
    agreed = agree_on_sets(world.allgather(requested), size, {}, rank)
    for ranks in [tuple(range(size))] + agreed:
        registry.add(ranks, world)
