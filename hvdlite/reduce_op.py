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
