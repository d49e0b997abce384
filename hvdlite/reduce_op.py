"""Reduction operators, shared by the core and the backends."""
from __future__ import annotations

import enum


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
