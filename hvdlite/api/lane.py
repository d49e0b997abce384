"""A reducer's lane (hvdlite/engine/lane.py), from the user's side: opened once per
agreed layout by one negotiated request, then one submission per bucket per step,
with no descriptor, no negotiation and no copy."""
from __future__ import annotations

import weakref
from typing import Any, Optional, Sequence

import numpy as np

from hvdlite.api import runtime
from hvdlite.api.process_set import ProcessSet
from hvdlite.api.submission import Call, synchronize
from hvdlite.engine.lane import CHECK_WORDS, LANE_DTYPES, LaneOp, StepMismatchError
from hvdlite.negotiation.requests import Kind

__all__ = ["CHECK_WORDS", "Lane", "StepMismatchError", "carries"]


def carries(dtype: str, device: str) -> bool:
    """Whether buckets of this dtype and device can go on a lane (HVDLITE_LANE, a host
    buffer of a dtype whose check words sum exactly)."""
    return (runtime.config().lane and device == "cpu"
            and np.dtype(dtype) in LANE_DTYPES)


class Lane:
    """Open a lane for buckets of ``counts`` elements each (check words included), on
    every rank of ``process_set`` (collective: every member calls it, in the same
    order of collectives). ``opened`` is False where the transport has no lanes."""

    def __init__(self, name: str, counts: Sequence[int], dtype: str,
                 process_set: Optional[ProcessSet]) -> None:
        call = Call(Kind.OPEN_LANE, name, process_set)
        self._engine = call.engine
        self.lane_id = synchronize(call.submit(None, shape=tuple(counts), dtype=dtype))
        self.opened = self.lane_id is not None
        if self.opened:       # gone with its reducer: the engine frees it once idle
            weakref.finalize(self, self._engine.close_lane, self.lane_id)

    def submit(self, buf: Any, scaled: int, scale: float, step: int, name: str,
               names: Sequence[str], failed_slot: Optional[int] = None) -> int:
        """Start summing ``buf`` (the flat buffer of bucket ``name``, of the gradients
        ``names``, at optimizer step ``step``); its first ``scaled`` elements are then
        multiplied by ``scale``. ``failed_slot``: the gradient this rank cannot reduce
        (every rank's handle then fails, naming it). Returns a handle."""
        op = LaneOp(buf, scaled, scale, step, name, names, failed_slot)
        return self._engine.submit_lane(self.lane_id, op)
