"""The backend seam: every backend implements the five collectives on contiguous
1-D buffers of one device, per process set, and returns a :class:`Work`.

The executor walks a chain of backends and uses the first whose ``supports``
accepts a request (Horovod's operation manager, torch c10d's ProcessGroup):
adding NCCL or a staged GPU path is one more entry, not an ``if`` in the
executor. A backend owns its communicator per process set (``open_set`` /
``close_set``, called on the engine thread when a set is registered or
removed); it receives the set's transport (hvdlite/transport/base.py), whose
``kind`` says what it can run on: an MPI-based backend takes the mpi4py
communicator of a transport of kind MPI (``comm``), a GPU backend bootstraps its
own communicator over it (an NCCL unique id broadcast), and any backend can move
host data with the transport's own ``*_array`` calls.

Buffers are arrays of the device's array namespace (NumPy on the CPU, CuPy on
a GPU). Completion is the backend's business: a CPU backend finishes before it
returns (``Done``); a GPU backend returns work that finishes on a stream, and
the engine completes the handles once ``done()`` says so.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence

import ml_dtypes
import numpy as np

from hvdlite.reduce_op import UFUNCS, ReduceOp  # noqa: F401  (UFUNCS: backends import it here)
from hvdlite.transport.base import Transport, TransportKind

Buffer = Any   # a contiguous 1-D array of the device's namespace (numpy.ndarray, cupy.ndarray)


class Work(Protocol):
    """A collective in progress. Work that also has ``ordered = True`` is queued on
    a device stream: what the engine queues after it on that stream (unpacking,
    scaling, the next pack into the same buffer, the fence its caller's stream waits
    on) runs after it, so the executor completes its handle at once and only keeps
    the inputs alive until ``done()``."""

    def done(self) -> bool:
        """True once the results are in the output buffers (never blocks)."""

    def wait(self) -> None:
        """Block until ``done()``."""


class Done:
    """Work that finished before the call returned (every blocking backend)."""
    __slots__ = ()

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return None


DONE = Done()


class Backend(Protocol):
    name: str

    def supports(self, kind: str, dtype: np.dtype, device: str, nbytes: int,
                 op: ReduceOp = ReduceOp.SUM) -> bool:
        """Whether this backend runs ``kind`` ("allreduce", "allgather", "broadcast",
        "alltoall", "reducescatter") on ``nbytes`` of ``dtype`` on ``device`` with
        reduction ``op`` (Adasum is not elementwise: only its own backend runs it)."""

    def reduction_dtype(self, dtype: np.dtype) -> np.dtype:
        """The dtype reductions of ``dtype`` run in (the fusion buffer's dtype)."""

    def open_set(self, set_id: int, transport: Transport) -> None:
        """Start serving a process set, whose ranks ``transport`` connects."""

    def close_set(self, set_id: int) -> None:
        """Release what ``open_set`` created (the transport is not ours)."""

    def allreduce(self, set_id: int, buf: Buffer, op: ReduceOp) -> Work:
        """Reduce ``buf`` in place across the set."""

    # Optional: ``allreduce_from(set_id, source, buf, op) -> Work`` reduces ``source``
    # into ``buf`` (``buf`` is not read). The executor uses it, where a backend has
    # it, for ``out = allreduce(x)``: copying x into a fresh output first costs
    # as much as a fast allreduce of it.

    def allgather(self, set_id: int, send: Buffer, recv: Buffer,
                  counts: Sequence[int]) -> Work:
        """Concatenate every rank's ``send`` into ``recv``; rank r sends ``counts[r]``
        elements. Byte buffers (uint8) for data of any dtype."""

    def broadcast(self, set_id: int, buf: Buffer, root: int) -> Work:
        """Overwrite ``buf`` on every rank with rank ``root``'s (set ranks)."""

    def alltoall(self, set_id: int, send: Buffer, send_counts: Sequence[int],
                 recv: Buffer, recv_counts: Sequence[int]) -> Work:
        """Send ``send_counts[r]`` consecutive elements to rank r; receive
        ``recv_counts[r]`` from rank r, in rank order."""

    def reducescatter(self, set_id: int, buf: Buffer, counts: Sequence[int],
                      out: Buffer, op: ReduceOp) -> Work:
        """Reduce ``buf`` across the set; rank r's slice (``counts[r]`` elements, in
        rank order) lands in ``out``. ``buf`` may be clobbered."""


class Traffic:
    """Bytes one backend sent and received for this rank, per collective kind.

    ``exact`` says whether the counts are what this rank put on and took off the
    wire (hvdlite's own point-to-point algorithms) or an estimate (MPI's own
    collectives, whose algorithm MPI chooses). Only the engine thread writes;
    each update replaces one immutable tuple, and ``snapshot`` copies the dict
    (one C-level operation under the GIL), so a user thread reading it never
    sees a half-updated count and needs no lock.
    """
    __slots__ = ("exact", "totals", "_by_kind")

    def __init__(self, exact: bool = True) -> None:
        self.exact = exact
        self.totals = (0, 0)                                   # (sent, received), every kind
        self._by_kind: dict[str, tuple[int, int, int]] = {}   # kind -> (calls, sent, received)

    def add(self, kind: str, sent: int, received: int) -> None:
        calls, total_sent, total_received = self._by_kind.get(kind, (0, 0, 0))
        self._by_kind[kind] = (calls + 1, total_sent + int(sent), total_received + int(received))
        self.totals = (self.totals[0] + int(sent), self.totals[1] + int(received))

    def snapshot(self) -> dict[str, dict[str, int]]:
        return {kind: {"calls": calls, "sent": sent, "received": received}
                for kind, (calls, sent, received) in dict(self._by_kind).items()}


class HostBackend:
    """What the MPI-based host backends share: the mpi4py communicator of a set on an
    MPI transport is theirs to use directly, half types are reduced widened (see
    widened_dtype), and a byte counter (``traffic``)."""
    name = "host"
    exact_traffic = True

    def __init__(self) -> None:
        self._comms: dict[int, Any] = {}
        self.traffic = Traffic(self.exact_traffic)
        # True once a set was opened on a transport of another kind than MPI
        # (torchrun's): these backends then decline every call, and the chain falls
        # through to the backend on the transport's collectives.
        self.declined = False

    def reduction_dtype(self, dtype: np.dtype) -> np.dtype:
        return widened_dtype(dtype)

    def open_set(self, set_id: int, transport: Transport) -> None:
        self.declined = transport.kind is not TransportKind.MPI
        if not self.declined:
            self._comms[set_id] = transport.comm

    def close_set(self, set_id: int) -> None:
        self._comms.pop(set_id, None)

    def allreduce_from(self, set_id: int, source: np.ndarray, buf: np.ndarray,
                       op: ReduceOp) -> Work:
        """Out of place by a copy; backends that can do better override this."""
        buf[...] = source
        return self.allreduce(set_id, buf, op)   # type: ignore[attr-defined]


class ScratchPair:
    """Two persistent receive buffers of one dtype, grown on demand: pipelined
    receives land in one while the other is reduced, and no message allocates (and
    page-faults) a fresh temporary."""

    def __init__(self) -> None:
        self._raw = np.empty(0, dtype=np.uint8)

    def pair(self, dtype: np.dtype, elems: int) -> tuple[np.ndarray, np.ndarray]:
        nbytes = elems * dtype.itemsize
        if 2 * nbytes > self._raw.nbytes:
            self._raw = np.zeros(2 * nbytes, dtype=np.uint8)
        raw = self._raw
        return raw[:nbytes].view(dtype), raw[nbytes: 2 * nbytes].view(dtype)


# MPICH rejects bfloat16 SUM and some Open MPI builds silently return garbage
# for it, so on host backends half types are reduced as float32 (packed with a
# widening copy). A GPU backend reduces them natively and says so.
_WIDENED = {np.dtype(np.float16): np.dtype(np.float32),
            np.dtype(ml_dtypes.bfloat16): np.dtype(np.float32)}


def widened_dtype(dtype: np.dtype) -> np.dtype:
    return _WIDENED.get(np.dtype(dtype), np.dtype(dtype))


def segment_bounds(counts: Sequence[int]) -> list[tuple[int, int]]:
    """[start, end) of consecutive segments of the given lengths."""
    bounds, start = [], 0
    for count in counts:
        bounds.append((start, start + count))
        start += count
    return bounds


def offsets(sizes: Sequence[int]) -> list[int]:
    """Start offset of each segment in a packed buffer."""
    return [start for start, _ in segment_bounds(sizes)]


def even_counts(total: int, parts: int) -> list[int]:
    """Split ``total`` into ``parts`` near-equal counts, the first ones larger."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]
