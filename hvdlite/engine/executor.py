"""Runs agreed responses: packs tensors, hands buffers to a backend, unpacks
(the packing itself is in packing.py).

Runs on the engine thread only. Every rank executes the same responses in
the same order (fused allreduce groups first, then the rest as agreed), so
the backends' calls always match across ranks. The code is written against
the array namespace of each request's device (NumPy on the CPU, CuPy on a
GPU); a backend may finish its work later (``Work.done()``), and a request's
handle completes only then (``progress``), unless the work is ordered on a
device stream: then the handle completes once everything after it is queued
behind it, and its caller's stream waits on the result's fence.
"""
from __future__ import annotations

import collections
import time
from typing import Any, Callable, Hashable, Optional, Sequence

import numpy as np

from hvdlite.backends.base import DONE, Work, even_counts
from hvdlite.engine import fusion
from hvdlite.engine.chain import BackendChain
from hvdlite.engine.devices import Fenced, array_namespace, described, device_type, ready_events
from hvdlite.engine.packing import as_bytes, direct_target, pack_group, pack_one, unpack_group
from hvdlite.engine.scaling import Scale, scale
from hvdlite.negotiation.requests import Kind, ReduceOp, Request, Response, to_dtype
from hvdlite.recording.recorder import ReductionCount
from hvdlite.reduce_op import OPS_BY_VALUE
from hvdlite.transport.base import Transport

Complete = Callable[[Request, Any], None]
Started = tuple[Work, Any, Any]   # a collective's work, its result, its backend (or None)
_PLAN_MEMO_SIZE = 64   # distinct agreed sets seen in steady state are few


class Executor:
    def __init__(self, config: Any, complete: Complete, timeline: Callable[[], Any]) -> None:
        self.config = config
        self.chain = BackendChain(config)
        self._complete = complete
        self._timeline = timeline
        self.fusion = fusion.FusionBuffers(array_namespace)
        self._fusion_work: dict[str, Work] = {}   # last work using each device's buffer
        self._plans: dict[Hashable, list[list[Response]]] = {}
        self._geometry: dict[int, tuple[int, int]] = {}   # set id -> (my rank, size) in the set
        self._in_flight: collections.deque[tuple[Work, Callable[[], None]]] = collections.deque()
        # Stream-ordered work already completed to its callers, with the requests whose
        # inputs it may still be reading (see _after).
        self._retiring: collections.deque[tuple[Work, Any]] = collections.deque()
        self.reductions = ReductionCount()      # HVDLITE_REPORT's gradients per step
        self._devices: dict[str, str] = {}      # device type -> this rank's last device

    def reconfigure(self, config: Any) -> None:
        """Apply a negotiated settings change (same point on every rank)."""
        self.config = config
        self.chain.configure(config)
        self.forget_plans()

    def open_set(self, set_id: int, transport: Transport) -> None:
        self._geometry[set_id] = (transport.rank, transport.size)
        self.chain.open_set(set_id, transport)

    def close_set(self, set_id: int) -> None:
        self._geometry.pop(set_id, None)
        self.chain.close_set(set_id)

    # -- running and completing ------------------------------------------------------
    def run(self, set_id: int, responses: Sequence[Response], pending: dict[str, Request],
            plan_key: Optional[Hashable] = None) -> None:
        """Run agreed responses. ``plan_key`` (the agreed cache bits of a fast-path
        round) lets steady-state steps reuse their fusion plan."""
        if self._retiring:
            self._retire()
        for group in self._plan(responses, plan_key):
            self._allreduce_group(set_id, group, [pending.get(r.name) for r in group])
        for response in responses:
            if response.desc.kind is not Kind.ALLREDUCE:
                request = pending.get(response.name)
                self._run_one(set_id, response, request)

    def _after(self, work: Work, finish: Callable[[], None], inputs: Any) -> None:
        if work.done():
            finish()
        elif getattr(work, "ordered", False):
            # Queued on the device's engine stream: what finish queues (unpack, scale,
            # the fence) runs after it on that stream and the caller's stream waits on
            # the fence, so the handle completes now, with no host synchronisation and
            # no polling. The inputs stay referenced until the stream is past the work,
            # so the framework cannot hand their memory to a new tensor while it is read.
            finish()
            self._retiring.append((work, inputs))
        else:
            self._in_flight.append((work, finish))

    def _retire(self) -> None:
        retiring = self._retiring
        while retiring and retiring[0][0].done():
            retiring.popleft()

    def progress(self) -> int:
        """Finish the work that is done (in order); the number finished."""
        self._retire()
        finished = 0
        while self._in_flight and self._in_flight[0][0].done():
            self._in_flight.popleft()[1]()
            finished += 1
        return finished

    @property
    def busy(self) -> bool:
        """Work a backend is still doing (a GPU stream): the engine keeps polling."""
        return bool(self._in_flight)

    def drain(self) -> None:
        while self._in_flight:
            work, finish = self._in_flight.popleft()
            work.wait()
            finish()
        while self._retiring:
            self._retiring.popleft()[0].wait()

    def _finish(self, request: Optional[Request], result: Any) -> None:
        self._finish_all([request], [result])

    def _finish_all(self, requests: Sequence[Optional[Request]], results: Sequence[Any]) -> None:
        """Complete requests of one device; on a GPU one fence, recorded after every
        result is written, is what each consumer's stream waits on."""
        mine = [(r, result) for r, result in zip(requests, results) if r is not None]
        if not mine:
            return
        device = mine[0][0].desc.device
        for index, (request, _) in enumerate(mine):
            if request.writeback is not None:    # an in-place op on a non-contiguous target
                array_namespace(device).copyto(request.writeback, request.output)
                mine[index] = (request, request.writeback)
        fence = described(device).fence(device) if device != "cpu" else None
        for request, result in mine:
            # A fenced result: the consumer's stream waits on the fence before use.
            self._complete(request, result if fence is None else Fenced(result, fence))

    def _plan(self, responses: Sequence[Response],
              plan_key: Optional[Hashable]) -> list[list[Response]]:
        plan = self._plans.get(plan_key) if plan_key is not None else None
        if plan is None:
            allreduces = [r for r in responses if r.desc.kind is Kind.ALLREDUCE]
            plan = fusion.plan_groups(
                allreduces, self.config.fusion_threshold, self.config.direct_threshold,
                lambda r: self.chain.reduction_dtype(r.dtype, r.desc.device))
            if plan_key is not None:
                if len(self._plans) >= _PLAN_MEMO_SIZE:
                    self._plans.pop(next(iter(self._plans)))
                self._plans[plan_key] = plan
        return plan

    def forget_plans(self) -> None:
        """The cache or the settings changed: a bit may now mean another response."""
        self._plans.clear()

    @staticmethod
    def _span(timeline: Any, requests: Sequence[Optional[Request]], phase: str,
              start: float) -> float:
        """Record a phase on the timeline; callers skip the call when there is none
        (the common case: every call saved counts on a lone op after idle)."""
        now = time.monotonic()
        for request in requests:
            if request is not None:
                timeline.span(request, phase, start or request.agreed_at, now)
        return now

    def _fusion_view(self, device: str, dtype: np.dtype, count: int) -> Any:
        """The device's fusion buffer as ``count`` elements of ``dtype``, once the
        work that last used it is done (or, on a stream, queued ahead of what comes next)."""
        previous = self._fusion_work.pop(device, None)
        if previous is not None and not getattr(previous, "ordered", False):
            previous.wait()          # stream-ordered work is behind us on the stream anyway
        return self.fusion.view(device, dtype, count)

    def _own_device(self, requests: Sequence[Optional[Request]], agreed: str) -> str:
        """The device this rank runs a response on. A response carries the
        coordinator's descriptor, whose device is rank 0's ("cuda:0"), while each
        rank reduces on its own GPU ("cuda:3"): its own request says which. A rank
        with no request in the group (it has joined) uses the last device of that
        type it had."""
        for request in requests:
            if request is not None:
                own = request.desc.device
                if own != "cpu":
                    self._devices[device_type(own)] = own
                return own
        return self._devices.get(device_type(agreed), agreed)

    # -- allreduce -------------------------------------------------------------
    def _allreduce_group(self, set_id: int, group: Sequence[Response],
                         requests: Sequence[Optional[Request]]) -> None:
        first = group[0]
        device = self._own_device(requests, first.desc.device)
        if device == "cpu":
            xp = np
        else:
            xp = array_namespace(device)
            described(device).prepare(device, ready_events(requests))
        wide = self.chain.reduction_dtype(first.dtype, device)
        op = OPS_BY_VALUE[first.desc.op]
        size = self._geometry[set_id][1]
        postscale = Scale(first.desc.postscale, size if op is ReduceOp.AVERAGE else 1)
        timeline = self._timeline()
        start = 0.0 if timeline is None else self._span(timeline, requests, "QUEUE", 0.0)
        self.reductions.add(len(group), sum(r.count for r in group) * wide.itemsize)
        if device != "cpu" and self._reduce_each(set_id, group, requests, xp, wide, op,
                                                 postscale, device):
            return
        direct = direct_target(requests, first.dtype, wide)
        if direct is not None:
            buf = direct
            backend = self.chain.pick("allreduce", wide, device, buf.nbytes, op)
            source = pack_one(xp, requests[0], buf, first.desc.prescale,
                              hasattr(backend, "allreduce_from"))
        else:
            counts = [r.count for r in group]
            buf = self._fusion_view(device, wide, sum(counts))
            pack_group(xp, requests, counts, buf, first.desc.prescale, op)
            backend = self.chain.pick("allreduce", wide, device, buf.nbytes, op)
            source = None
        timeline = self._timeline()     # looked up per phase: the user may start one
        if timeline is not None:
            start = self._span(timeline, requests, "MEMCPY_IN_FUSION_BUFFER", start)
        if source is None:
            work = backend.allreduce(set_id, buf, op)
        else:
            work = backend.allreduce_from(set_id, source, buf, op)
        if direct is None:
            self._fusion_work[device] = work

        def finish() -> None:
            timeline = self._timeline()
            if timeline is not None:
                begin = self._span(timeline, requests, _activity(backend, "allreduce"), start)
            if direct is None:
                unpack_group(xp, requests, counts, buf, postscale)
            elif postscale.needed:
                postscale.apply(xp, buf)
            if timeline is not None:
                self._span(timeline, requests, "MEMCPY_OUT_FUSION_BUFFER", begin)
            self._finish_all(requests, [None if r is None else r.output for r in requests])
        self._after(work, finish, requests)

    def _reduce_each(self, set_id: int, group: Sequence[Response],
                     requests: Sequence[Optional[Request]], xp: Any, wide: np.dtype,
                     op: ReduceOp, postscale: Scale, device: str) -> bool:
        """A backend that reduces many buffers in one call (NCCL's group calls: one
        launch) reduces each tensor from its input straight into its output, without
        copies through the fusion buffer (on a GPU each copy is a kernel launch, ~10 us
        of Python); Average is its Sum, divided here after. Decided from
        agreed fields only, so every rank takes the same path: not when a rank has
        joined (it would send zeros from no tensor), with a prescale, or in a widened
        dtype."""
        first = group[0]
        if first.desc.prescale != 1.0 or wide != first.dtype or any(r.joined for r in group):
            return False
        backend = self.chain.pick("allreduce", first.dtype, device, 0, op)
        many = getattr(backend, "allreduce_many", None)
        work = many(set_id, [(r.array, r.output) for r in requests], op) if many else None
        if work is None:
            return False

        def finish() -> None:
            for request in requests:
                postscale.apply(xp, request.output)
            self._finish_all(requests, [r.output for r in requests])
        self._after(work, finish, requests)
        return True

    # -- everything else ---------------------------------------------------------
    def _run_one(self, set_id: int, response: Response, request: Optional[Request]) -> None:
        kind = response.desc.kind
        timeline = self._timeline()
        start = 0.0 if timeline is None else self._span(timeline, [request], "QUEUE", 0.0)
        if request is not None and request.desc.device != "cpu":
            described(request.desc.device).prepare(request.desc.device, ready_events([request]))
        work, result, backend = self._collective(set_id, response, request)

        def finish() -> None:
            timeline = self._timeline()
            if timeline is not None and backend is not None:   # a barrier is agreement only
                self._span(timeline, [request], _activity(backend, kind.value), start)
            self._finish(request, result() if callable(result) else result)
        self._after(work, finish, request)

    def _collective(self, set_id: int, response: Response, request: Optional[Request]) -> Started:
        kind = response.desc.kind
        if kind is Kind.ALLGATHER:
            return self._allgather(set_id, response, request)
        if kind is Kind.BROADCAST:
            buf = as_bytes(request.output)
            backend = self.chain.pick("broadcast", buf.dtype, request.desc.device, buf.nbytes)
            return backend.broadcast(set_id, buf, response.desc.root), request.output, backend
        if kind is Kind.ALLTOALL:
            return self._alltoall(set_id, response, request)
        if kind is Kind.REDUCESCATTER:
            return self._reducescatter(set_id, response, request)
        if kind is Kind.JOIN:
            return DONE, response.result, None
        return DONE, None, None   # BARRIER: agreement itself proves every rank arrived

    def _reducescatter(self, set_id: int, response: Response, request: Request) -> Started:
        desc = request.desc          # this rank's own device (the response names rank 0's)
        rank, size = self._geometry[set_id]
        rows = desc.shape[0] if desc.shape else 1
        row_elems = int(np.prod(desc.shape[1:], dtype=np.int64))
        my_rows = list(desc.splits) if desc.splits is not None else even_counts(rows, size)
        counts = [r * row_elems for r in my_rows]
        xp = array_namespace(desc.device)
        dtype = to_dtype(desc.dtype)
        wide = self.chain.reduction_dtype(dtype, desc.device)
        buf = self._fusion_view(desc.device, wide, sum(counts))
        buf[...] = request.array.reshape(-1)
        scale(xp, buf, desc.prescale)
        out = xp.empty(counts[rank], dtype=wide)
        op = OPS_BY_VALUE[desc.op]
        backend = self.chain.pick("reducescatter", wide, desc.device, buf.nbytes, op)
        work = backend.reducescatter(set_id, buf, counts, out, op)
        self._fusion_work[desc.device] = work

        def result() -> Any:
            Scale(desc.postscale, size if op is ReduceOp.AVERAGE else 1).apply(xp, out)
            return out.astype(dtype, copy=False).reshape((my_rows[rank],) + desc.shape[1:])
        return work, result, backend

    def _allgather(self, set_id: int, response: Response, request: Request) -> Started:
        desc = request.desc
        dtype = to_dtype(desc.dtype)
        row_bytes = int(np.prod(desc.shape[1:], dtype=np.int64)) * dtype.itemsize
        counts = [d * row_bytes for d in response.first_dims]
        xp = array_namespace(desc.device)
        out = xp.empty((sum(response.first_dims),) + desc.shape[1:], dtype=dtype)
        send, recv = as_bytes(request.array), as_bytes(out)
        backend = self.chain.pick("allgather", recv.dtype, desc.device, recv.nbytes)
        return backend.allgather(set_id, send, recv, counts), out, backend

    def _alltoall(self, set_id: int, response: Response, request: Request) -> Started:
        desc = request.desc
        rank = self._geometry[set_id][0]
        dtype = to_dtype(desc.dtype)
        row_bytes = int(np.prod(desc.shape[1:], dtype=np.int64)) * dtype.itemsize
        send_rows = response.split_matrix[rank]
        recv_rows = [row[rank] for row in response.split_matrix]
        xp = array_namespace(desc.device)
        out = xp.empty((sum(recv_rows),) + desc.shape[1:], dtype=dtype)
        send, recv = as_bytes(request.array), as_bytes(out)
        backend = self.chain.pick("alltoall", recv.dtype, desc.device, recv.nbytes)
        work = backend.alltoall(set_id, send, [r * row_bytes for r in send_rows],
                                recv, [r * row_bytes for r in recv_rows])
        return work, (out, np.asarray(recv_rows, dtype=np.int32)), backend


def _activity(backend: Any, kind: str) -> str:
    """A backend's part of a collective on the timeline, named as Horovod's (MPI_ALLREDUCE)."""
    return f"{backend.name}_{kind}".upper()
