"""A lane (hvdlite/engine/lane.py), from the user's side: opened once per agreed
layout by one negotiated request, then one submission per bucket per step, with no
descriptor, no negotiation and no copy. The reducer's lanes sum; a sharded optimizer's
reduce-scatter and allgather (``LaneKind``)."""
from __future__ import annotations

import weakref
from typing import Any, Optional, Sequence

import numpy as np

from hvdlite.api import runtime
from hvdlite.api.process_set import ProcessSet
from hvdlite.api.submission import Call, synchronize
from hvdlite.engine.lane import CHECK_WORDS, LANE_DTYPES, LaneKind, LaneOp, StepMismatchError
from hvdlite.negotiation.requests import Kind

__all__ = ["CHECK_WORDS", "Lane", "LaneKind", "StepMismatchError", "carries"]


def carries(dtype: str, device: str) -> bool:
    """Whether buckets of this dtype and device can go on a lane (HVDLITE_LANE, a host
    buffer of a dtype whose check words sum exactly)."""
    return (runtime.config().lane and device == "cpu"
            and np.dtype(dtype) in LANE_DTYPES)


class Lane:
    """Open a lane for buckets of ``counts`` elements each (check words included), on
    every rank of ``process_set`` (collective: every member calls it, in the same
    order of collectives). A reduce-scatter's or an allgather's ``segments``: each
    bucket's rank by rank, each ending in check words (``counts``: their sums).
    ``opened`` is False where the transport has no lanes of this kind."""

    def __init__(self, name: str, counts: Sequence[int], dtype: str,
                 process_set: Optional[ProcessSet], kind: LaneKind = LaneKind.SUM,
                 segments: Sequence[Sequence[int]] = ()) -> None:
        call = Call(Kind.OPEN_LANE, name, process_set)
        self._engine = call.engine
        splits = tuple(int(n) for each in segments for n in each) or None
        self.lane_id = synchronize(call.submit(
            None, shape=tuple(counts), dtype=dtype, splits=splits,
            settings=(("kind", int(kind)),)))
        self.opened = self.lane_id is not None
        if self.opened:       # gone with its reducer: the engine frees it once idle
            weakref.finalize(self, self._engine.close_lane, self.lane_id)

    def submit(self, buf: Any, scaled: int, scale: float, step: int, name: str,
               names: Sequence[str], failed_slot: Optional[int] = None,
               out: Any = None) -> int:
        """Start summing ``buf`` (the flat buffer of bucket ``name``, of the gradients
        ``names``, at optimizer step ``step``); its first ``scaled`` elements are then
        multiplied by ``scale``. ``failed_slot``: the gradient this rank cannot reduce
        (every rank's handle then fails, naming it). A reduce-scatter or an allgather
        lands in ``out`` (its first ``scaled`` elements scaled). Returns a handle."""
        op = LaneOp(buf, scaled, scale, step, name, names, failed_slot, out=out)
        return self._engine.submit_lane(self.lane_id, op)
