"""Which gradients share a bucket: DDP's layout, from the parameter list alone.

Parameters go into buckets in reverse registration order, the order backward
roughly produces their gradients (DDP's assumption: a model uses its layers in
the order it defines them). The first bucket of each kind (dtype and device)
closes past 1 MiB, so its reduction starts while most of backward is still to
come; the others past the cap (HVDLITE_BUCKET_BYTES, 25 MiB as DDP's); a cap of
0 gives every gradient a bucket of its own, and ``all`` (ONE_BUCKET) one bucket of
each kind, the first not made small either. A ``groups=`` group is reduced
together: it has buckets of its own (one per kind), whatever their size.

Every rank computes the same layout from the same specs, which the reducer
makes sure of with one exchange (``hvdlite.api.variable_check``).
"""
from __future__ import annotations

from typing import Any, Callable, Hashable, Optional, Sequence

from hvdlite.config_values import ONE_BUCKET
from hvdlite.reducer.settings import Groups

FIRST_BUCKET_BYTES = 1 << 20     # DDP's: "experiments showed 1MB is a reasonable value"


def group_positions(count: int, groups: Groups,
                    position_of: Callable[[Any], Optional[int]],
                    among: Optional[Sequence[int]] = None) -> list[list[int]]:
    """``groups=`` as lists of parameter positions: ``n`` groups of consecutive
    parameters, or the given lists of parameters (``position_of`` finds each; one
    it does not find, None, is not reduced here and is left out). ``among``: the
    positions reduced (default: all ``count``); the others are in no group."""
    if groups is None:
        return []
    positions = list(range(count)) if among is None else list(among)
    if isinstance(groups, int):
        size = max(1, -(-len(positions) // groups))
        return [positions[start:start + size] for start in range(0, len(positions), size)]
    kept = set(positions)
    found = [[p for p in map(position_of, group) if p is not None and p in kept]
             for group in groups]
    return [group for group in found if group]


def plan(nbytes: Sequence[int], kinds: Sequence[Hashable], cap: int,
         groups: Sequence[Sequence[int]] = (),
         among: Optional[Sequence[int]] = None) -> list[list[int]]:
    """The buckets, as lists of parameter positions: each group's, then the rest.
    ``among``: the positions reduced (default: all); the others get no bucket."""
    grouped = {i for group in groups for i in group}
    kept = set(range(len(nbytes)) if among is None else among)
    buckets = [b for group in groups for b in cut(nbytes, kinds, group, None)]
    rest = [i for i in reversed(range(len(nbytes))) if i not in grouped and i in kept]
    return buckets + cut(nbytes, kinds, rest, cap)


def cut(nbytes: Sequence[int], kinds: Sequence[Hashable], order: Sequence[int],
        cap: Optional[int], first: int = FIRST_BUCKET_BYTES) -> list[list[int]]:
    """``order`` cut into buckets of one kind: a new one past ``cap`` bytes (None or
    ONE_BUCKET: no cap, one bucket of each kind; 0: one position per bucket), the first
    of each kind past min(first, cap)."""
    if cap == 0:
        return [[i] for i in order]
    if cap is not None and cap >= ONE_BUCKET:
        cap = None
    first = min(first, cap) if cap else 0
    open_: dict[Hashable, list[int]] = {}
    sizes: dict[Hashable, int] = {}
    closed: set[Hashable] = set()          # kinds past their first bucket
    done: list[list[int]] = []
    for i in order:
        kind = kinds[i]
        limit = cap if kind in closed else first
        bucket = open_.setdefault(kind, [])
        if bucket and limit and sizes[kind] + nbytes[i] > limit:
            done.append(bucket)
            closed.add(kind)
            bucket = open_[kind] = []
            sizes[kind] = 0
        bucket.append(i)
        sizes[kind] = sizes.get(kind, 0) + nbytes[i]
    return done + [b for b in open_.values() if b]
