"""Horovod's elastic API over restart-based recovery (framework-neutral parts).

``hvdlite.torch.elastic`` and ``hvdlite.keras.elastic`` add their framework's
State; this package holds what they share: :class:`State`, :class:`ObjectState`,
the :func:`run` decorator, the committed file and preemption (see ``driver``).
"""
from hvdlite.elastic.driver import run, run_fn, world_is_whole
from hvdlite.elastic.preemption import PREEMPTED_EXIT_CODE
from hvdlite.elastic.state import Handler, ObjectState, State
from hvdlite.errors import (CollectiveFailedError, HorovodInternalError, HostsUpdatedError,
                            HostsUpdatedInterrupt, StateError)

__all__ = ["run", "run_fn", "world_is_whole", "PREEMPTED_EXIT_CODE", "Handler", "ObjectState",
           "State", "CollectiveFailedError", "HorovodInternalError", "HostsUpdatedError",
           "HostsUpdatedInterrupt", "StateError"]
