"""The multi-rank suite's own bookkeeping between ranks (each test's outcome, the job's
exit code), on the launcher's transport: MPI under mpiexec, torch.distributed over
Gloo under torchrun (where mpi4py may not be installed). Never used by hvdlite itself:
a channel of its own, so a test's outcome never interleaves with hvdlite's traffic."""
from __future__ import annotations

import functools
import os
import time
from typing import Any


def under_torchrun() -> bool:
    """torchrun (torch.distributed.run) started this rank: hvdlite.init() opens the torch
    transport here, and so does this module."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def transport_label() -> str:
    """Which transport the ranks run on, as test ids and skip reasons name it."""
    return "gloo" if under_torchrun() else "mpi"


class _MpiChannel:
    def __init__(self) -> None:
        from mpi4py import MPI
        self._comm, self._max = MPI.COMM_WORLD.Dup(), MPI.MAX
        self.rank = self._comm.Get_rank()

    def allgather(self, obj: Any) -> list[Any]:
        return self._comm.allgather(obj)

    def worst(self, code: int) -> int:
        return int(self._comm.allreduce(code, op=self._max))

    def close(self) -> None:
        self._comm.Free()

    def idle_until_all_arrive(self) -> None:
        """A barrier waited for in Python (polling), not inside the transport's library."""
        done = self._comm.Ibarrier()
        while not done.Test():
            time.sleep(0.001)


class _TorchChannel:
    def __init__(self) -> None:
        import torch.distributed as dist
        # The default group first, as hvdlite.init() would make it (it then uses this one);
        # then a group of its own, made here, before any of hvdlite's, on every rank.
        if not dist.is_initialized():
            dist.init_process_group("gloo")
        from hvdlite.transport.handoff import Handoff
        self._dist, self._group = dist, dist.new_group(backend="gloo")
        self.rank = dist.get_rank()
        self._handoff = Handoff()

    def allgather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self._dist.get_world_size()
        self._dist.all_gather_object(out, obj, group=self._group)
        return out

    def worst(self, code: int) -> int:
        import torch
        value = torch.tensor([code], dtype=torch.int64)
        self._dist.all_reduce(value, op=self._dist.ReduceOp.MAX, group=self._group)
        # The job's last operation: Gloo's thread gives its reference back a moment
        # after the call returns, taking the GIL, and had the interpreter begun to
        # finalize by then, the rank would abort (exit -6). close() waits for it.
        self._handoff.hold([value])
        return int(value.item())

    def close(self) -> None:
        """Every group torn down before the interpreter exits (left to exit-time
        destructors, Gloo's threads have aborted a rank: exit code -6), and Gloo's
        threads done with the tensors of the last operations (hvdlite/transport/handoff.py)."""
        self._dist.destroy_process_group()
        if not self._handoff.await_released(30.0):
            raise RuntimeError("Gloo still holds the outcome's tensor after 30 s")

    def idle_until_all_arrive(self) -> None:
        work = self._dist.barrier(group=self._group, async_op=True)
        while not work.is_completed():
            time.sleep(0.001)
        work.wait()


@functools.lru_cache(maxsize=None)
def channel() -> Any:
    """This job's channel (one per process; tests/mpi/run.py opens it before pytest
    starts, so every rank makes it at the same point)."""
    return _TorchChannel() if under_torchrun() else _MpiChannel()
