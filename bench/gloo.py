"""torch.distributed over gloo, the baseline a PyTorch user would otherwise reach for,
timed on the same ops and in the same run as hvdlite's allreduce figures.

Gloo's collectives run on worker threads of its C++ process group, so it pays the
same hand-offs as hvdlite's engine, without a Python engine or a negotiation round:
how far a target sits below gloo's figure says whether any framework with a
background thread meets it on this machine. Optional: without torch the benchmark
prints that this baseline was skipped and why.
"""
from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

from bench.timing import lone_median, seconds_per_call

if TYPE_CHECKING:     # imported where MPI launched the benchmark only: not under torchrun
    from mpi4py import MPI


def missing_reason() -> Optional[str]:
    """Why the gloo baseline cannot run here, or None if it can."""
    try:
        import torch.distributed as dist
    except ImportError as exc:
        return f"torch is not installed ({exc})"
    if not dist.is_available() or not dist.is_gloo_available():
        return "this torch build has no gloo backend"
    return None


@contextlib.contextmanager
def gloo_group(comm: MPI.Comm) -> Iterator[Any]:
    """torch.distributed's default group over gloo on the ranks of ``comm`` (rank 0
    picks the TCP port and tells the others); destroyed on exit."""
    import torch.distributed as dist
    port = comm.bcast(29500 + os.getpid() % 2000 if comm.Get_rank() == 0 else None, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=comm.Get_rank(), world_size=comm.Get_size())
    try:
        yield dist
    finally:
        dist.destroy_process_group()


def lone_op(comm: MPI.Comm, repeats: int, idle_s: float) -> float:
    """``lone_median`` of gloo's 4-byte ``all_reduce`` (float32, Sum, in place)."""
    import torch
    tiny = torch.zeros(1, dtype=torch.float32)
    with gloo_group(comm) as dist:
        dist.all_reduce(tiny)                      # connects: not part of the figure
        return lone_median(comm, lambda: dist.all_reduce(tiny), repeats, idle_s)


def many_small(comm: MPI.Comm, seconds: float) -> tuple[float, float]:
    """Seconds for 200 async 4 KiB ``all_reduce`` calls waited on in order, and for one
    800 KiB ``all_reduce``: the pair hvdlite's per-tensor ratio is set against."""
    import torch
    small = [torch.zeros(1024, dtype=torch.float32) for _ in range(200)]
    big = torch.zeros(200 * 1024, dtype=torch.float32)
    with gloo_group(comm) as dist:
        def two_hundred() -> None:
            works = [dist.all_reduce(t, async_op=True) for t in small]
            for work in works:
                work.wait()
        one: Callable[[], None] = lambda: dist.all_reduce(big)
        return seconds_per_call(two_hundred, seconds, comm), seconds_per_call(one, seconds, comm)
