"""The check that every rank trains the same variables, for any framework: the
ranks exchange (name, shape, dtype) lists once, and a difference becomes a
MismatchError on every rank naming the variable, instead of a hang on an op
that some rank never submits."""
from __future__ import annotations

from typing import Any, Optional, Sequence

from hvdlite.api import objects, runtime
from hvdlite.api.process_set import ProcessSet
from hvdlite.errors import MismatchError

Spec = tuple[str, tuple, str]     # (name, shape, dtype name)


def describe_difference(specs_by_rank: Sequence[Sequence[Spec]]) -> Optional[str]:
    """What differs between the ranks' variable lists, or None."""
    counts = [len(s) for s in specs_by_rank]
    for index in range(max(counts, default=0)):
        seen: dict[Any, list[int]] = {}
        for rank, specs in enumerate(specs_by_rank):
            seen.setdefault(tuple(specs[index]) if index < len(specs) else None, []).append(rank)
        if len(seen) > 1:
            parts = "; ".join(
                f"ranks {ranks} have " + ("no such variable" if spec is None else
                                          f"'{spec[0]}' shape={spec[1]} dtype={spec[2]}")
                for spec, ranks in seen.items())
            return f"variable #{index} differs: {parts}"
    return None


def check_same_variables(specs: Sequence[Spec], what: str,
                         process_set: Optional[ProcessSet] = None,
                         name: Optional[str] = None) -> None:
    """Raise MismatchError on every rank if the ranks' specs differ. ``name`` names
    the exchange (default ``<what>.variable_check``)."""
    every = objects.allgather_object([tuple(s) for s in specs],
                                     name=name or f"{what}.variable_check",
                                     process_set=process_set)
    problem = describe_difference(every)
    if problem:
        raise MismatchError(f"rank {runtime.rank()}: {what}: the ranks' variables differ, so "
                            f"they cannot be trained together: {problem}. Build the same "
                            "model on every rank.")
