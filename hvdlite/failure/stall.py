"""Stall inspector: rank 0 notices tensors some ranks submitted and others did not."""
from __future__ import annotations

import logging
import time
from typing import Any, Optional

from hvdlite.negotiation.coordinator import Coordinator

_log = logging.getLogger("hvdlite")
# Appended when a stall error is due while the negotiation round itself is stuck.
STUCK_ROUND_NOTE = ("The StallError waits for the current negotiation round, which some "
                    "rank has not joined; a rank that has exited or stopped answering is "
                    "reported as PeerLostError (see HVDLITE_PEER_TIMEOUT).")


def tell_stuck(held: dict[int, str], told: set[int]) -> None:
    """While a negotiation round is stuck: a stall past HVDLITE_STALL_SHUTDOWN_TIME
    (``held``, by set) becomes a StallError only through a full round, which cannot
    run until this round completes. Say so once per set (``told``, updated); if a
    peer is gone, the liveness check reports it."""
    told.intersection_update(held.keys())   # delivered ones may recur
    for set_id, message in held.items():
        if set_id not in told:
            told.add(set_id)
            _log.error("%s %s", message, STUCK_ROUND_NOTE)


def _limits(config: Any) -> list[float]:
    """The stall thresholds in force (a value of 0 turns its check off)."""
    return [t for t in (config.stall_check_time, config.stall_shutdown_time) if t > 0]


def report_after(config: Any) -> Optional[float]:
    """Seconds after which a pending request is sent to the coordinator even if it
    is cached, so rank 0 can see who is missing. None when inspection is off."""
    limits = _limits(config)
    return min(limits) / 4 if limits else None


class StallInspector:
    def __init__(self, config: Any, ranks: tuple[int, ...]) -> None:
        self.config = config
        self.ranks = ranks  # set rank -> global rank, for messages users can act on
        self._next_check = 0.0

    def check(self, coordinator: Coordinator) -> Optional[str]:
        """Warn about stalled tensors; return a message if they must become an error."""
        now = time.monotonic()
        if now < self._next_check:     # checked first: this runs after every round
            return None
        limits = _limits(self.config)
        if not limits:
            return None
        self._next_check = now + min(1.0, min(limits) / 4)
        if self.config.stall_check_time > 0:
            for name, have, missing, waited in coordinator.stalled(now, self.config.stall_check_time):
                if coordinator.mark_warned(name):
                    _log.warning(self._describe(name, have, missing, waited))
        if self.config.stall_shutdown_time > 0:
            stalled = coordinator.stalled(now, self.config.stall_shutdown_time)
            if stalled:
                return self._describe(*stalled[0]) + (
                    f" Stopping: stalled longer than HVDLITE_STALL_SHUTDOWN_TIME="
                    f"{self.config.stall_shutdown_time:g} s.")
        return None

    def _describe(self, name: str, have: list[int], missing: list[int], waited: float) -> str:
        have_g = [self.ranks[r] for r in have]
        missing_g = [self.ranks[r] for r in missing]
        return (f"Stall: for {waited:.1f} s ranks {have_g} have been waiting on tensor "
                f"'{name}', which ranks {missing_g} have not submitted (missing ranks: "
                f"{missing_g}). One or more ranks are on a different code path, slower, "
                "or submitted it under another name; check data sharding and conditional "
                "collectives.")
