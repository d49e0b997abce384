"""The defaults init() chooses from the transport, on every rank alike: on the torch
transport (torchrun), ranks computing on CPUs tick every 3 ms instead of 1 (each
negotiation round is a Gloo collective); on MPI the fixed cycle stays. A cycle the
user set (HVDLITE_CYCLE_TIME or Horovod's HOROVOD_CYCLE_TIME) is never changed.

Runs under mpiexec (tests/mpi) and under torchrun (make test-gloo)."""
from __future__ import annotations

import os

import hvdlite as hvd
from hvdlite.api import runtime
from hvdlite.core import defaults


def test_the_cycle_follows_the_transport_unless_set() -> None:
    cycle = runtime.config().cycle_time
    every = hvd.allgather_object(cycle)
    assert every == [cycle] * hvd.size()
    if "HVDLITE_CYCLE_TIME" in os.environ or "HOROVOD_CYCLE_TIME" in os.environ:
        return
    on_gloo = runtime.transport_name() == "gloo"
    assert cycle == (defaults.GLOO_CYCLE_MS if on_gloo else 1.0)
    reasons = runtime.engine().defaults_chosen
    assert any(r.startswith("HVDLITE_CYCLE_TIME=") for r in reasons) == on_gloo
