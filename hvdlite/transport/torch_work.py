"""torch's asynchronous work for the torch transport (torch_transport.py): a Work as a
Pending, held tensors and all, and the negotiation round over Gloo."""
from __future__ import annotations

import array
import datetime
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from hvdlite.reduce_op import ReduceOp
from hvdlite.transport import waits
from hvdlite.transport.handoff import HANDOFF

_OPS = {ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.MIN: dist.ReduceOp.MIN,
        ReduceOp.MAX: dist.ReduceOp.MAX, ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT}


class TorchPending:
    """A torch Work as a Pending; holds the tensors the operation reads or writes until
    it is complete, then HANDOFF holds them, until Gloo's thread has let go of them too
    (hvdlite/transport/handoff.py). A failed operation raises from the ``Test`` that sees
    it end. ``then`` runs once, when it is found complete."""

    def __init__(self, work: Any, *keep: torch.Tensor,
                 then: Optional[Callable[[], Any]] = None) -> None:
        self._work, self._keep, self._then = work, keep, then
        self._done = False

    def Test(self) -> bool:  # noqa: N802 (the Pending protocol's name)
        if not self._done and self._work.is_completed():
            self._work.wait()       # returns at once, or raises the operation's failure
            self._finish()
        return self._done

    def wait(self) -> None:
        """Until complete, for the data collectives: asleep, waking for the engine's
        liveness ticks on its thread (hvdlite/transport/waits.py)."""
        if not self._done:
            waits.wait_blocked([self])

    def _finish(self) -> None:
        self._done = True
        if self._then is not None:
            self._then()
        HANDOFF.hold(self._keep)
        self._keep = ()

    def wait_for(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` (at least 1 ms: torch counts whole milliseconds,
        and 0 is no limit), the GIL released; True once complete."""
        if self._done:
            return True
        try:
            self._work.wait(datetime.timedelta(milliseconds=max(1, round(timeout_s * 1e3))))
        except RuntimeError:
            if not self._work.is_completed():     # timed out: torch raises for that too
                return False
            # It ended as the wait timed out: a wait now returns, or raises the
            # operation's own failure.
            self._work.wait()
        self._finish()
        return True


def _reduce_options(op: Any) -> Any:
    options = dist.AllreduceOptions()
    options.reduceOp = op
    return options


# Made once: each round and each host reduction calls the group itself, not
# dist.all_reduce, whose checks cost more than Gloo's own allreduce at one rank
# (25 us against 17 us a call, measured here).
_BAND = _reduce_options(dist.ReduceOp.BAND)
OPTIONS = {op: _reduce_options(torch_op) for op, torch_op in _OPS.items()}


class TorchLane:
    """A lane (hvdlite/engine/lane.py) on a Gloo group of its own, whose rank is the
    transport's. Each of its collectives is one asynchronous Gloo allreduce, the one
    operation of Gloo's whose Work this lane has seen complete and fail as a sum's: a
    reduce-scatter sums the whole buffer and keeps this rank's segment (the bytes the
    negotiated path moves); an allgather sums a buffer that is zeros but for this
    rank's segment (twice an allgather's bytes, exact: every element is one rank's
    value plus zeros, and -0.0 arrives as 0.0 on every rank alike)."""

    def __init__(self, group: Any, rank: int) -> None:
        self._group, self._rank = group, rank

    def start_sum(self, buf: np.ndarray) -> TorchPending:
        return self._sum(buf)

    def start_reduce_scatter(self, buf: np.ndarray, out: np.ndarray,
                             counts: Sequence[int]) -> TorchPending:
        """The sum of ``buf`` (summed in place), of which this rank keeps its segment
        (``counts``: each rank's, in rank order) in ``out``."""
        lo = sum(counts[:self._rank])
        mine = buf.reshape(-1)[lo:lo + counts[self._rank]]
        return self._sum(buf, then=lambda: np.copyto(out.reshape(-1), mine))

    def start_allgather(self, buf: np.ndarray, out: np.ndarray,
                        counts: Sequence[int]) -> TorchPending:
        """Every rank's ``buf`` (``counts[k]`` elements from rank k) into ``out``, in rank
        order."""
        lo = sum(counts[:self._rank])
        flat = out.reshape(-1)
        flat[:lo] = 0
        flat[lo:lo + counts[self._rank]] = buf.reshape(-1)
        flat[lo + counts[self._rank]:] = 0
        return self._sum(out)

    def _sum(self, buf: np.ndarray, then: Optional[Callable[[], Any]] = None) -> TorchPending:
        tensor = torch.from_numpy(buf)
        return TorchPending(self._group.allreduce([tensor], OPTIONS[ReduceOp.SUM]), tensor,
                            then=then)

    def close(self) -> None:
        self._group = None      # its threads end with the group


class TorchRound:
    def __init__(self, group: Any, vector: array.array) -> None:
        self._group, self._vector = group, vector

    def start(self) -> TorchPending:
        # The vector's own memory: the reduction lands where the engine reads it.
        # int64, not uint64: Gloo's bitwise AND is the same on either. A tensor of each
        # round's own, which only the round holds (hvdlite/transport/handoff.py).
        tensor = torch.frombuffer(self._vector, dtype=torch.int64)
        return TorchPending(self._group.allreduce([tensor], _BAND), tensor)

    def free(self) -> None:
        pass


def block(pending: Sequence[TorchPending]) -> None:
    """Wait for each in turn (the transport's blocking object exchanges)."""
    for each in pending:
        each.wait()
