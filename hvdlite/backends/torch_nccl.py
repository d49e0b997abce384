"""CUDA buffers over torch's own NCCL, for process sets on the torch transport (torchrun).

Under torchrun the world is torch.distributed's, and torch ships its NCCL: each
process set whose ranks each have a GPU of their own gets one NCCL process group
of its members, made at the set's first GPU collective (every member runs the same
collective at the same point, on the engine thread, as ``NcclBackend`` makes its
communicator). The group is a c10d backend object built from the job's store,
under a prefix set rank 0 draws and broadcasts: only the members take part, and no
entry in torch's own group table is made, whose names depend on every group a
process made before (ranks of other sets would disagree).

Ranks that share a GPU (NCCL refuses them) are served by the staged backend,
which on this transport moves the host copy over Gloo (hvdlite/backends/gpu_sets.py:
the per-set communicators and that decision, shared with CuPy's NCCL backend).

Streams: the engine's buffers are CuPy arrays on its own stream; they reach torch
as tensors over the same memory (DLPack), and each collective is issued, as a
synchronous one (``asyncOp`` False), with that stream as torch's current one: torch's
NCCL then queues it on that very stream, after the packing queued there and before
whatever the engine queues next, and nothing waits on the host. (A torch older than
2.7 has no ``asyncOp``: NCCL runs on its own stream, and ``Work.wait`` makes the
engine's stream wait for it.)

Average is Sum here, divided afterwards by the executor, as on every path (see
hvdlite/backends/nccl.py for why never NCCL's own average). Uneven allgathers are
gathered padded to the longest part; uneven reducescatters are an allreduce of
which each rank keeps its part (correct by construction; twice the traffic).

``DEVICE`` says how buffers become tensors, which group backend is made, and
which stream is current: the CPU stand-in (tests/standin) swaps in host arrays
and Gloo, so this code runs at 2 and 4 ranks in CI.

Every tensor handed to a group goes to HANDOFF once its collective returns: torch's
threads (Gloo's workers in the stand-in) may drop the last reference to it after
Python has moved on, and doing so while the interpreter finalizes aborts the process
(hvdlite/transport/handoff.py).
"""
from __future__ import annotations

from typing import Any, Callable, ContextManager, Optional, Sequence

import ml_dtypes
import numpy as np

from hvdlite.backends.base import Buffer
from hvdlite.backends.cuda import StreamWork, current_stream
from hvdlite.backends.gpu_sets import PerSetNccl
from hvdlite.reduce_op import ReduceOp
from hvdlite.transport.base import Transport, TransportKind
from hvdlite.transport.handoff import HANDOFF

_DTYPES = ("float16", "float32", "float64", "int8", "uint8", "int32", "int64", "bfloat16")
_SERVED = frozenset(np.dtype(ml_dtypes.bfloat16) if n == "bfloat16" else np.dtype(n)
                    for n in _DTYPES)
_ELEMENTWISE = frozenset({ReduceOp.SUM, ReduceOp.AVERAGE, ReduceOp.MIN, ReduceOp.MAX,
                          ReduceOp.PRODUCT})


def _torch() -> Any:
    import torch     # only here: the transport that brings sets to this backend is torch's
    return torch


def _torch_dtype(dtype: np.dtype) -> Any:
    return getattr(_torch(), np.dtype(dtype).name)     # "bfloat16", "float32"... as torch's


class CudaDevice:
    """Real GPUs: CuPy buffers as torch tensors over their memory, NCCL groups, the
    engine's CuPy stream as torch's current stream."""
    group_backend = "nccl"

    @staticmethod
    def tensor(buf: Buffer) -> Any:
        # Bytes, then torch's dtype: DLPack carries uint8 in every CuPy release.
        raw = _torch().from_dlpack(buf.reshape(-1).view(np.uint8))
        return raw.view(_torch_dtype(buf.dtype))

    @staticmethod
    def on_engine_stream() -> ContextManager[Any]:
        # torch's current stream of the stream's own device (what NCCL orders itself
        # after); the engine's streams live as long as the process, so each is wrapped once.
        ptr = current_stream().ptr
        external = _EXTERNAL.get(ptr)
        if external is None:
            external = _EXTERNAL[ptr] = _torch().cuda.ExternalStream(ptr)
        return _torch().cuda.stream(external)


_EXTERNAL: dict[int, Any] = {}    # engine stream pointer -> torch's ExternalStream of it


DEVICE: Any = CudaDevice


class TorchNcclBackend(PerSetNccl):
    name = "torch-nccl"

    def supports(self, kind: str, dtype: np.dtype, device: str, nbytes: int,
                 op: ReduceOp = ReduceOp.SUM) -> bool:
        return (self._enabled and bool(self._sets) and device.startswith("cuda")
                and np.dtype(dtype) in _SERVED and op in _ELEMENTWISE)

    def open_set(self, set_id: int, transport: Transport) -> None:
        if transport.kind is TransportKind.TORCH:      # MPI's sets are nccl's
            self._serve(set_id, transport)
        self._staged.open_set(set_id, transport)

    def _make(self, transport: Transport) -> Any:
        return transport.device_group(DEVICE.group_backend)

    def _release(self, group: Any) -> None:
        shutdown = getattr(group, "shutdown", None)     # not on every torch release's groups
        if shutdown is not None:
            shutdown()

    @staticmethod
    def _run(issue: Callable[..., Any], *tensors: Any) -> None:
        """Issue a collective on ``tensors`` with the engine's stream current; that
        stream then waits for it (the caller returns the stream's work: the engine's
        next work follows)."""
        with DEVICE.on_engine_stream():
            _wait(issue(*tensors))
        HANDOFF.hold(tensors)

    def allreduce(self, set_id: int, buf: Buffer, op: ReduceOp) -> Any:
        group = self._communicator(set_id)
        if group is None:
            return self._staged.allreduce(set_id, buf, op)
        if buf.size:
            self._run(lambda t: group.allreduce([t], _options("Allreduce", op)),
                      DEVICE.tensor(buf))
        self._count_allreduce(set_id, buf.nbytes)
        return StreamWork(current_stream())

    def broadcast(self, set_id: int, buf: Buffer, root: int) -> Any:
        group = self._communicator(set_id)
        if group is None:
            return self._staged.broadcast(set_id, buf, root)
        torch = _torch()
        options = torch.distributed.BroadcastOptions()
        options.rootRank, options.rootTensor = root, 0
        if hasattr(options, "asyncOp"):               # on the engine's stream (_options)
            options.asyncOp = False
        if buf.size:
            self._run(lambda t: group.broadcast([t], options), DEVICE.tensor(buf))
        self._count_broadcast(set_id, buf.nbytes, root)
        return StreamWork(current_stream())

    def allgather(self, set_id: int, send: Buffer, recv: Buffer,
                  counts: Sequence[int]) -> Any:
        """Counts may differ per rank: then every part travels padded to the longest,
        and each is copied to its place after."""
        group = self._communicator(set_id)
        if group is None:
            return self._staged.allgather(set_id, send, recv, counts)
        longest, size = max(counts, default=0), len(counts)
        if longest:
            with DEVICE.on_engine_stream():
                _gather_padded(group, DEVICE.tensor(send), DEVICE.tensor(recv), counts,
                               longest, size)
        others = (sum(counts) - send.size) * send.itemsize
        self.traffic.add("allgather", others, others)
        return StreamWork(current_stream())

    def alltoall(self, set_id: int, send: Buffer, send_counts: Sequence[int],
                 recv: Buffer, recv_counts: Sequence[int]) -> Any:
        group = self._communicator(set_id)
        if group is None:
            return self._staged.alltoall(set_id, send, send_counts, recv, recv_counts)
        if send.size or recv.size:
            self._run(lambda into, out_of: group.alltoall_base(
                into, out_of, [int(c) for c in recv_counts], [int(c) for c in send_counts],
                _options("AllToAll")), DEVICE.tensor(recv), DEVICE.tensor(send))
        me = self._sets[set_id].rank
        self.traffic.add("alltoall", sum(send_counts) - send_counts[me],
                         sum(recv_counts) - recv_counts[me])
        return StreamWork(current_stream())

    def reducescatter(self, set_id: int, buf: Buffer, counts: Sequence[int],
                      out: Buffer, op: ReduceOp) -> Any:
        """NCCL's reduce-scatter where every part is as long; else an allreduce of which
        this rank keeps its part."""
        group = self._communicator(set_id)
        if group is None:
            return self._staged.reducescatter(set_id, buf, counts, out, op)
        me = self._sets[set_id].rank
        if len(set(counts)) == 1 and buf.size:
            self._run(lambda into, out_of: group._reduce_scatter_base(
                into, out_of, _options("ReduceScatter", op)), DEVICE.tensor(out),
                DEVICE.tensor(buf))
        elif buf.size:
            start = sum(counts[:me])
            self._run(lambda t: group.allreduce([t], _options("Allreduce", op)),
                      DEVICE.tensor(buf))
            with DEVICE.on_engine_stream():
                DEVICE.tensor(out).copy_(DEVICE.tensor(buf)[start: start + counts[me]])
        others = buf.nbytes - out.nbytes
        self.traffic.add("reducescatter", others, others)
        return StreamWork(current_stream())


_OPTIONS: dict[tuple[str, Any], Any] = {}


def _options(kind: str, op: Optional[ReduceOp] = None) -> Any:
    """torch's options of a collective (``kind``: "Allreduce", "ReduceScatter",
    "AllToAll", "Allgather"), made once per kind and op. ``asyncOp`` False: torch's NCCL
    then runs the collective on the current stream, the engine's, and its wait has
    nothing to do (an async one runs on NCCL's own stream, which the engine's must
    then wait for; measured on an H200 that cost more than the collective)."""
    options = _OPTIONS.get((kind, op))
    if options is None:
        c10d = _torch()._C._distributed_c10d      # AllgatherOptions is not re-exported
        options = _OPTIONS[(kind, op)] = getattr(c10d, f"{kind}Options")()
        if op is not None:
            options.reduceOp = _reduce_op(op)
        if hasattr(options, "asyncOp"):           # torch >= 2.7
            options.asyncOp = False
    return options


def _reduce_op(op: ReduceOp) -> Any:
    """Average is a Sum here: the executor divides after (module docstring)."""
    dist = _torch().distributed
    return {ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.AVERAGE: dist.ReduceOp.SUM,
            ReduceOp.MIN: dist.ReduceOp.MIN, ReduceOp.MAX: dist.ReduceOp.MAX,
            ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT}[op]


def _wait(work: Optional[Any]) -> None:
    if work is not None:        # torch 2.11's NCCL returns none for a synchronous op
        work.wait()


def _gather_padded(group: Any, send: Any, recv: Any, counts: Sequence[int], longest: int,
                   size: int) -> None:
    """Allgather of parts of ``counts`` elements into ``recv``, on the current stream:
    directly where every part is ``longest`` long, else through a padded buffer."""
    torch = _torch()
    if all(count == longest for count in counts):
        _wait(group._allgather_base(recv, send, _options("Allgather")))
        HANDOFF.hold((recv, send))
        return
    padded = torch.zeros(longest, dtype=send.dtype, device=send.device)
    padded[: send.numel()].copy_(send)
    gathered = torch.empty(longest * size, dtype=send.dtype, device=send.device)
    _wait(group._allgather_base(gathered, padded, _options("Allgather")))
    HANDOFF.hold((gathered, padded))
    start = 0
    for rank, count in enumerate(counts):
        recv[start: start + count].copy_(gathered[rank * longest: rank * longest + count])
        start += count
