"""The check that every rank trains the same variables, for any framework: the
ranks exchange (name, shape, dtype) lists once, and a difference in count, shape
or dtype becomes a MismatchError on every rank naming the variable, instead of a
hang on an op that some rank never submits.

Names are reported but not compared: the same model can name its variables
differently on different ranks. Horovod's resume pattern loads the checkpoint on
rank 0 only and builds the model afresh on the others, and Keras names a loaded
Sequential's variables 'conv2d/kernel' where a built one has
'sequential/conv2d/kernel'; a rank that built another model first gets 'dense_1'
for 'dense'. Horovod compares nothing; shapes and dtypes are what the
collectives need to agree on."""
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
        seen: dict[Any, list[int]] = {}      # (shape, dtype) or None -> ranks
        names: dict[Any, str] = {}            # (shape, dtype) -> the first such rank's name
        for rank, specs in enumerate(specs_by_rank):
            key = tuple(specs[index][1:]) if index < len(specs) else None
            seen.setdefault(key, []).append(rank)
            if key is not None:
                names.setdefault(key, specs[index][0])
        if len(seen) > 1:
            parts = "; ".join(
                f"ranks {ranks} have " + ("no such variable" if key is None else
                                          f"'{names[key]}' shape={key[0]} dtype={key[1]}")
                for key, ranks in seen.items())
            return f"variable #{index} differs: {parts}"
    return None


def check_same_variables(specs: Sequence[Spec], what: str,
                         process_set: Optional[ProcessSet] = None,
                         name: Optional[str] = None) -> list[str]:
    """Raise MismatchError on every rank if the ranks' specs differ. Returns the
    variables' names on the set's first rank, the same list on every rank: names for
    the ops on these variables that every rank agrees on. ``name`` names the exchange
    (default ``<what>.variable_check``)."""
    every = objects.allgather_object([tuple(s) for s in specs],
                                     name=name or f"{what}.variable_check",
                                     process_set=process_set)
    problem = describe_difference(every)
    if problem:
        raise MismatchError(f"rank {runtime.rank()}: {what}: the ranks' variables differ, so "
                            f"they cannot be trained together: {problem}. Build the same "
                            "model on every rank.")
    return [spec[0] for spec in every[0]] if every else []
