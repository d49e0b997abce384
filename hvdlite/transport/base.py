"""The transport seam: everything the core needs from the world of ranks, as one protocol.

The engine, the process-set registry, topology detection, the liveness check and the
backends talk to a :class:`Transport`, never to mpi4py or torch.distributed. MPI
(``hvdlite.transport.mpi_transport``) and torch.distributed
(``hvdlite.transport.torch_transport``) implement it, as does the in-process fake the
unit tests run on (``tests/unit/fake_transport.py``); all pass the same conformance
checks (``tests/transport_conformance.py``). ``hvdlite.transport.choice`` picks the
world's transport for how the process was started.

What a transport provides, in the order the engine uses it:

- what: ``kind``, a :class:`TransportKind`: which backends can move its data;
- who: ``rank`` and ``size`` within this transport's group of ranks;
- pace: ``idle_tick_s``, how often an idle engine joins a round on it;
- negotiation: a bitwise-AND allreduce of a vector of 64-bit words, started without
  blocking (``band_round``), so the engine can watch for lost peers while it waits;
- small objects: pickled ``allgather`` and ``bcast`` (set-up), and ``gather_awaited``
  and ``bcast_awaited`` to rank 0 / from rank 0 (a full negotiation round), whose
  pending parts the engine waits on itself;
- process sets: ``dup``, ``split`` and ``split_node`` give transports over subgroups;
  ``free`` releases one;
- liveness: ``liveness_channel`` gives pings and verdicts on a private context;
- agreed buckets: ``lane_channel`` gives sums started without blocking, on a context
  of their own (hvdlite/engine/lane.py);
- data: ``allreduce_array``, ``broadcast_array``, ``allgather_array`` and
  ``alltoall_array`` on host NumPy
  buffers, for a transport-generic backend, each waited on through
  hvdlite/transport/waits.py (on the engine's thread, with its liveness ticks: a peer
  frozen inside one is found). A backend is opened on the transport itself; one of
  kind MPI also has ``comm``, the mpi4py communicator the MPI-based backends run on;
- the end: ``abort`` ends the whole job; ``failures`` are the exception types a call
  raises when the world broke underneath it (a peer died).

Rules every implementation keeps (the conformance checks test them):
collectives are called in the same order on every rank of a group; a group's ranks
are numbered 0..size-1 in order of the split key (ties: by parent rank); a split
with ``color=None`` is a collective call that returns None to that rank.
Only the engine thread calls a transport once the engine runs.
"""
from __future__ import annotations

import array
import enum
from typing import Any, Callable, Optional, Protocol, Sequence, runtime_checkable

import numpy as np

from hvdlite.reduce_op import ReduceOp


class TransportKind(enum.Enum):
    """What a transport is, for the backends that can only run on one kind: the MPI-based
    host backends and CuPy's NCCL need an mpi4py communicator (``Transport.comm``), torch's
    NCCL needs torch.distributed's store (``device_group``). Every kind has the ``*_array``
    data calls, which the transport backend (hvdlite/backends/on_transport.py) runs on."""
    MPI = "mpi"
    TORCH = "torch"


class Pending(Protocol):
    """A started non-blocking operation. ``Test`` is mpi4py's name on purpose: an MPI
    request satisfies this protocol as it is, so the round's hot path (started and
    tested every engine cycle) pays for no wrapper object."""

    def Test(self) -> bool:  # noqa: N802
        """True once complete (then true on every later call)."""
        ...


class BlockingPending(Pending, Protocol):
    """A pending operation the engine can wait on blocked instead of polling
    (waiting.RoundWaiter): one that a library runs on threads of its own (torch's Gloo),
    or a round through the node's shared memory (asleep on a futex). A poll there only
    tests a flag, and each poll is a wake-up taken from training."""

    def wait_for(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` seconds; True once complete. A failed operation
        raises its error."""
        ...


# How the engine waits on pending operations (waiting.RoundWaiter.wait): polling them,
# or blocked on them (BlockingPending),
# while it runs the stall inspector and the liveness check.
Await = Callable[[Sequence[Pending]], None]


class BandRound(Protocol):
    """A negotiation round over one vector, made once per process set and started
    every engine cycle: when a started round completes, the vector holds the bitwise
    AND of every rank's vector."""

    def start(self) -> Pending: ...

    def free(self) -> None:
        """Before the transport it runs on is freed."""
        ...


class LivenessChannel(Protocol):
    """Pings and loss verdicts, on a context private to liveness: they never match a
    collective, and a peer stuck in a collective still has its pings delivered."""

    def ping(self, ranks: Sequence[int]) -> None: ...

    def drain(self) -> tuple[set[int], list[tuple[int, str]]]:
        """The ranks heard from since the last drain, and the verdicts received as
        (reporter, text). Never blocks."""
        ...

    def tell(self, ranks: Sequence[int], text: str) -> None:
        """Send a verdict; waits a bounded time for it to leave (a peer may be dead)."""
        ...


class LaneChannel(Protocol):
    """In-place sums on a context of their own (hvdlite/engine/lane.py): matched with
    the other ranks' in the order each rank starts them, never with another collective
    of the transport, so they can be started at any time without a negotiation round."""

    def start_sum(self, buf: np.ndarray) -> Pending:
        """Start summing ``buf`` (contiguous, host) across the ranks, into ``buf``."""
        ...

    # A channel may also have (hvdlite/engine/lane.py opens lanes of a kind only where
    # it does): start_reduce_scatter(buf, out, counts), the sum of ``buf`` with each
    # rank's segment of ``counts`` into its ``out``; start_allgather(buf, out, counts),
    # every rank's ``buf`` into ``out``, segment by segment.

    def close(self) -> None:
        """Every member closes it, once nothing started on it is pending."""
        ...


@runtime_checkable
class Transport(Protocol):
    name: str
    kind: TransportKind
    label: str             # how messages name it: "MPI", "torch.distributed (gloo)"
    lost_rank_wait: str    # what would wait for a lost rank at the end (why the job aborts)
    rank: int
    size: int
    failures: tuple[type[BaseException], ...]
    # While the world is the only process set, an idle engine joins a round once per
    # tick (waiting.IdleTicks), and a round is overdue after liveness.OVERDUE_TICKS
    # ticks: longer where a round costs the ranks more CPU.
    idle_tick_s: float

    # -- negotiation -------------------------------------------------------------------
    def band_round(self, vector: array.array) -> BandRound: ...

    # -- small objects (pickled) ---------------------------------------------------------
    def allgather(self, obj: Any) -> list[Any]: ...

    def bcast(self, obj: Any, root: int = 0) -> Any: ...

    def gather_awaited(self, obj: Any, wait: Await) -> Optional[list[Any]]:
        """Every rank's ``obj`` on rank 0 (None elsewhere), each step waited by ``wait``."""
        ...

    def bcast_awaited(self, obj: Any, wait: Await) -> Any:
        """Rank 0's ``obj`` on every rank, each step waited by ``wait``."""
        ...

    # -- process sets ---------------------------------------------------------------------
    def dup(self) -> "Transport": ...

    def split(self, color: Optional[int], key: int) -> Optional["Transport"]: ...

    def split_node(self, key: int) -> "Transport":
        """The ranks that share this rank's node (memory domain)."""
        ...

    def free(self) -> None: ...

    # -- liveness ---------------------------------------------------------------------------
    def liveness_channel(self) -> LivenessChannel: ...

    # -- agreed buckets -------------------------------------------------------------------
    def lane_channel(self) -> Optional[LaneChannel]:
        """A new lane over this transport's ranks (collective), or None where the
        transport has none (the buckets are then negotiated as other requests)."""
        ...

    # -- data (host NumPy buffers, contiguous) ------------------------------------------
    def allreduce_array(self, buf: np.ndarray, op: ReduceOp) -> None:
        """In place; SUM, MIN, MAX or PRODUCT (AVERAGE and ADASUM are the backends')."""
        ...

    def broadcast_array(self, buf: np.ndarray, root: int) -> None: ...

    def allgather_array(self, send: np.ndarray, recv: np.ndarray,
                        counts: Sequence[int]) -> None:
        """``recv`` is every rank's ``send`` in rank order; ``counts`` in elements."""
        ...

    def alltoall_array(self, send: np.ndarray, send_counts: Sequence[int],
                       recv: np.ndarray, recv_counts: Sequence[int]) -> None:
        """``send``'s consecutive parts of ``send_counts[r]`` elements go to rank r;
        ``recv`` is what every rank sent this one, in rank order (``recv_counts``)."""
        ...

    # -- the end -----------------------------------------------------------------------------
    def abort(self, status: int) -> None: ...


DATA_OPS = (ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT)


def check_data_op(rank: int, op: ReduceOp) -> None:
    """The operators a transport reduces itself; the others are a backend's work, so
    reaching here with one is a bug in the caller, named as such."""
    if op not in DATA_OPS:
        from hvdlite.errors import UsageError
        raise UsageError(f"rank {rank}: a transport's allreduce_array takes "
                         f"{[o.name for o in DATA_OPS]}, not {op.name}; Average divides "
                         "a SUM afterwards and Adasum runs on its own backend")
