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

# (name, shape, dtype name), or with a fourth field: whether it is trained (an
# optimizer's frozen parameters are compared too: the ranks must freeze alike).
Spec = tuple


def _described(name: str, key: tuple) -> str:
    text = f"'{name}' shape={key[0]} dtype={key[1]}"
    return text if len(key) < 3 else text + (" trainable" if key[2] else " frozen")


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
                                          _described(names[key], key))
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
    return agree_variables(specs, what, process_set, name)[0]


def agree_variables(specs: Sequence[Spec], what: str, process_set: Optional[ProcessSet] = None,
                    name: Optional[str] = None,
                    present: Optional[Sequence[bool]] = None) -> tuple[list[str], list[bool]]:
    """``check_same_variables``, also returning which variables some rank marked
    ``present`` (not compared; default all), in the same one exchange."""
    mine = [(tuple(s), True if present is None else bool(present[i]))
            for i, s in enumerate(specs)]
    gathered = objects.allgather_object(mine, name=name or f"{what}.variable_check",
                                        process_set=process_set)
    every = [[spec for spec, _ in rank_specs] for rank_specs in gathered]
    anywhere = [any(rank_specs[i][1] for rank_specs in gathered if i < len(rank_specs))
                for i in range(len(specs))]
    problem = describe_difference(every)
    if problem:
        frozen = _only_frozen_differs(every)
        cause = ("Freeze and unfreeze parameters (requires_grad, trainable) alike on every "
                 "rank, between the same steps." if frozen else
                 "Build the same model on every rank.")
        raise MismatchError(f"rank {runtime.rank()}: {what}: the ranks' variables differ, so "
                            f"they cannot be trained together: {problem}. {cause}")
    return ([spec[0] for spec in every[0]] if every else []), anywhere


def _only_frozen_differs(specs_by_rank: Sequence[Sequence[Spec]]) -> bool:
    """Whether the ranks' lists differ only in which variables are trained."""
    shapes = {tuple(tuple(spec[1:3]) for spec in specs) for specs in specs_by_rank}
    return len(shapes) == 1
