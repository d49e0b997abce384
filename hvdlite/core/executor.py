"""Runs agreed responses: packs tensors, calls a backend, unpacks results.

Runs on the engine thread only. Every rank executes the same responses in
the same order (fused allreduce groups first, then the rest as agreed), so
the MPI calls here always match across ranks.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Hashable, Optional, Sequence

import numpy as np
from mpi4py import MPI

from hvdlite.backends import even_counts
from hvdlite.backends.mpi import MpiBackend
from hvdlite.backends.ring import RingBackend
from hvdlite.core import fusion
from hvdlite.core.requests import Kind, ReduceOp, Request, Response, to_dtype

Complete = Callable[[Request, Any], None]
_PLAN_MEMO_SIZE = 64   # distinct agreed sets seen in steady state are few


class Executor:
    def __init__(self, config: Any, complete: Complete, timeline: Callable[[], Any]) -> None:
        self.config = config
        self._complete = complete
        self._timeline = timeline
        self._mpi = MpiBackend()
        self._ring = RingBackend(config.ring_chunk)
        self._fusion = fusion.FusionBuffer()
        self._plans: dict[Hashable, list[list[Response]]] = {}

    def backend_for(self, nbytes: int) -> Any:
        choice = self.config.allreduce
        if choice == "auto":
            choice = "ring" if nbytes >= self.config.ring_threshold else "mpi"
        return self._ring if choice == "ring" else self._mpi

    def run(self, comm: MPI.Comm, responses: Sequence[Response],
            pending: dict[str, Request], plan_key: Optional[Hashable] = None) -> None:
        """Run agreed responses. ``plan_key`` (the agreed cache bits of a fast-path
        round) lets steady-state steps reuse their fusion plan."""
        for group in self._plan(responses, plan_key):
            self._allreduce_group(comm, group, [pending.get(r.name) for r in group])
        for response in responses:
            if response.desc.kind is not Kind.ALLREDUCE:
                request = pending.get(response.name)
                result = self._run_one(comm, response, request)
                if request is not None:
                    self._complete(request, result)

    def _plan(self, responses: Sequence[Response],
              plan_key: Optional[Hashable]) -> list[list[Response]]:
        key = (plan_key, self.config.fusion_threshold)
        plan = self._plans.get(key) if plan_key is not None else None
        if plan is None:
            allreduces = [r for r in responses if r.desc.kind is Kind.ALLREDUCE]
            plan = fusion.plan_groups(allreduces, self.config.fusion_threshold)
            if plan_key is not None:
                if len(self._plans) >= _PLAN_MEMO_SIZE:
                    self._plans.pop(next(iter(self._plans)))
                self._plans[key] = plan
        return plan

    def forget_plans(self) -> None:
        """The cache changed: a bit may now mean another response."""
        self._plans.clear()

    def _span(self, requests: Sequence[Optional[Request]], phase: str, start: float) -> float:
        timeline = self._timeline()
        if timeline is None:
            return 0.0
        now = time.monotonic()
        for request in requests:
            if request is not None:
                timeline.span(request.desc.name, phase, start or request.agreed_at, now)
        return now

    # -- allreduce -------------------------------------------------------------
    def _allreduce_group(self, comm: MPI.Comm, group: Sequence[Response],
                         requests: Sequence[Optional[Request]]) -> None:
        first = group[0]
        wide = fusion.reduction_dtype(first.dtype)
        op = ReduceOp(first.desc.op)
        postscale = _Scale(first.desc.postscale, comm.Get_size() if op is ReduceOp.AVERAGE else 1)
        start = self._span(requests, "queue", 0.0)
        direct = self._direct_target(requests, first.dtype, wide)
        if direct is not None:
            buf = direct
            self._pack_one(requests[0], buf, first.desc.prescale)
        else:
            counts = [r.count for r in group]
            buf = self._fusion.view(wide, sum(counts))
            self._pack(requests, counts, buf, first.desc.prescale)
        start = self._span(requests, "memcpy_in", start)
        self.backend_for(buf.nbytes).allreduce(comm, buf, op)
        start = self._span(requests, "allreduce", start)
        if direct is not None:
            postscale.apply(buf)
        else:
            self._unpack(requests, counts, buf, postscale)
        self._span(requests, "memcpy_out", start)
        for request in requests:
            if request is not None:
                self._complete(request, request.output)

    @staticmethod
    def _direct_target(requests: Sequence[Optional[Request]], dtype: np.dtype,
                       wide: np.dtype) -> Optional[np.ndarray]:
        """A lone tensor already in its reduction dtype is reduced in its own output."""
        if len(requests) != 1 or requests[0] is None or dtype != wide:
            return None
        output = requests[0].output
        return output.reshape(-1) if output is not None and output.flags.c_contiguous else None

    @staticmethod
    def _pack_one(request: Optional[Request], buf: np.ndarray, prescale: float) -> None:
        source = request.array.reshape(-1)
        if not np.shares_memory(source, buf):
            buf[...] = source
        _scale(buf, prescale)

    @staticmethod
    def _pack(requests: Sequence[Optional[Request]], counts: Sequence[int],
              buf: np.ndarray, prescale: float) -> None:
        if all(request is not None for request in requests):
            np.concatenate([r.array.reshape(-1) for r in requests], out=buf, casting="unsafe")
        else:
            for request, start, count in zip(requests, fusion.offsets(counts), counts):
                piece = buf[start:start + count]
                if request is None:      # this rank has joined: contribute zeros
                    piece[...] = 0
                else:
                    piece[...] = request.array.reshape(-1)
        _scale(buf, prescale)

    @staticmethod
    def _unpack(requests: Sequence[Optional[Request]], counts: Sequence[int],
                buf: np.ndarray, postscale: "_Scale") -> None:
        postscale.apply(buf)
        for request, start, count in zip(requests, fusion.offsets(counts), counts):
            if request is not None:
                np.copyto(request.output, buf[start:start + count].reshape(
                    request.output.shape), casting="unsafe")

    # -- everything else ---------------------------------------------------------
    def _run_one(self, comm: MPI.Comm, response: Response, request: Optional[Request]) -> Any:
        kind = response.desc.kind
        start = self._span([request], "queue", 0.0)
        if kind is Kind.ALLGATHER:
            result = _allgather(comm, response, request)
        elif kind is Kind.BROADCAST:
            comm.Bcast([_bytes(request.output), MPI.BYTE], root=response.desc.root)
            result = request.output
        elif kind is Kind.ALLTOALL:
            result = _alltoall(comm, response, request)
        elif kind is Kind.REDUCESCATTER:
            result = self._reducescatter(comm, response, request)
        elif kind is Kind.JOIN:
            result = response.result
        else:  # BARRIER: agreement itself proves every rank arrived
            result = None
        self._span([request], kind.value, start)
        return result

    def _reducescatter(self, comm: MPI.Comm, response: Response, request: Request) -> np.ndarray:
        desc = response.desc
        size, rank = comm.Get_size(), comm.Get_rank()
        rows = desc.shape[0] if desc.shape else 1
        row_elems = int(np.prod(desc.shape[1:], dtype=np.int64))
        my_rows = even_counts(rows, size)
        counts = [r * row_elems for r in my_rows]
        wide = fusion.reduction_dtype(to_dtype(desc.dtype))
        buf = self._fusion.view(wide, sum(counts))
        buf[...] = request.array.reshape(-1)
        _scale(buf, desc.prescale)
        out = np.empty(counts[rank], dtype=wide)
        op = ReduceOp(desc.op)
        self.backend_for(buf.nbytes).reducescatter(comm, buf, counts, out, op)
        _Scale(desc.postscale, size if op is ReduceOp.AVERAGE else 1).apply(out)
        return out.astype(to_dtype(desc.dtype), copy=False).reshape((my_rows[rank],) + desc.shape[1:])


def _scale(buf: np.ndarray, factor: float) -> None:
    if factor != 1.0:
        # Integer tensors are scaled in float64 and truncated toward zero, as Horovod does.
        np.multiply(buf, factor, out=buf, casting="unsafe")


class _Scale:
    """Post-reduction scaling. Average divides by the size rather than multiplying
    by its reciprocal: 6 * (1/3) is 1.999..., which truncates to 1 for integers."""
    __slots__ = ("factor", "divisor")

    def __init__(self, factor: float, divisor: int) -> None:
        self.factor, self.divisor = factor, divisor

    def apply(self, buf: np.ndarray) -> None:
        if self.divisor != 1:
            np.true_divide(buf, self.divisor, out=buf, casting="unsafe")
        _scale(buf, self.factor)


def _bytes(array: np.ndarray) -> np.ndarray:
    return array.reshape(-1).view(np.uint8)


def _allgather(comm: MPI.Comm, response: Response, request: Request) -> np.ndarray:
    desc = request.desc
    itemsize = to_dtype(desc.dtype).itemsize
    row_bytes = int(np.prod(desc.shape[1:], dtype=np.int64)) * itemsize
    counts = [d * row_bytes for d in response.first_dims]
    out = np.empty((sum(response.first_dims),) + desc.shape[1:], dtype=to_dtype(desc.dtype))
    comm.Allgatherv([_bytes(request.array), MPI.BYTE],
                    [_bytes(out), (counts, fusion.offsets(counts)), MPI.BYTE])
    return out


def _alltoall(comm: MPI.Comm, response: Response, request: Request) -> tuple[np.ndarray, np.ndarray]:
    desc = request.desc
    rank = comm.Get_rank()
    row_bytes = int(np.prod(desc.shape[1:], dtype=np.int64)) * to_dtype(desc.dtype).itemsize
    send_rows = response.split_matrix[rank]
    recv_rows = [row[rank] for row in response.split_matrix]
    send = [r * row_bytes for r in send_rows]
    recv = [r * row_bytes for r in recv_rows]
    out = np.empty((sum(recv_rows),) + desc.shape[1:], dtype=to_dtype(desc.dtype))
    comm.Alltoallv([_bytes(request.array), (send, fusion.offsets(send)), MPI.BYTE],
                   [_bytes(out), (recv, fusion.offsets(recv)), MPI.BYTE])
    return out, np.asarray(recv_rows, dtype=np.int32)
