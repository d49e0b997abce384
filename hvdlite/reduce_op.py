"""Reduction operators, shared by the core and the backends."""
from __future__ import annotations

import enum
from typing import Any, Callable

import numpy as np


class ReduceOp(enum.IntEnum):
    """Horovod's operator values; module-level aliases ``hvdlite.Average`` etc."""
    AVERAGE = 0
    SUM = 1
    ADASUM = 2     # adaptive summation (hvdlite.backends.adasum); allreduce only
    MIN = 3
    MAX = 4
    PRODUCT = 5


# Value -> operator as a dict lookup: ``ReduceOp(value)`` runs Python code in the enum
# machinery, a cost paid once per tensor on the submit and execute paths.
OPS_BY_VALUE: dict[int, ReduceOp] = {int(op): op for op in ReduceOp}


# The elementwise reductions of the host backends and of the node's shared memory
# (Average is a Sum; the executor divides afterwards, together with the postscale factor).
UFUNCS: dict[ReduceOp, Callable[..., Any]] = {
    ReduceOp.SUM: np.add, ReduceOp.AVERAGE: np.add, ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum, ReduceOp.PRODUCT: np.multiply}


def identity(op: ReduceOp, dtype: Any) -> Any:
    """The value that leaves ``op``'s result unchanged: what a joined rank contributes
    to an allreduce, so that Min, Max and Product cover the ranks that still have data
    (zeros would make a Min of positive values 0, and every Product 0). Sum, Average
    and Adasum take zeros (Adasum keeps a zero vector's partner as it is)."""
    if op is ReduceOp.PRODUCT:
        return 1
    if op not in (ReduceOp.MIN, ReduceOp.MAX):
        return 0
    dtype = np.dtype(dtype)
    if dtype.kind in "iu":
        return np.iinfo(dtype).max if op is ReduceOp.MIN else np.iinfo(dtype).min
    return np.inf if op is ReduceOp.MIN else -np.inf   # float buffers (halves widen first)
