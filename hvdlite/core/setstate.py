"""The engine's view of one process set on this rank."""
from __future__ import annotations

import dataclasses
from typing import Optional

from mpi4py import MPI

from hvdlite.core.cache import ResponseCache
from hvdlite.core.negotiation import Coordinator
from hvdlite.core.requests import Request


@dataclasses.dataclass
class SetState:
    set_id: int
    ranks: tuple[int, ...]          # global ranks, ascending
    comm: MPI.Comm                  # private communicator for negotiation and data
    cache: ResponseCache
    coordinator: Optional[Coordinator]
    pending: dict[str, Request] = dataclasses.field(default_factory=dict)

    @classmethod
    def create(cls, set_id: int, ranks: tuple[int, ...], comm: MPI.Comm,
               cache_capacity: int) -> "SetState":
        coordinator = Coordinator(comm.Get_size()) if comm.Get_rank() == 0 else None
        return cls(set_id, ranks, comm, ResponseCache(cache_capacity), coordinator)
