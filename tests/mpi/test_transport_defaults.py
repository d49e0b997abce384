"""The defaults init() chooses from the transport, on every rank alike: on the torch
transport (torchrun), ranks that share the CPUs they compute on tick every 3 ms instead
of 1 (each negotiation round is a Gloo collective); with a core per rank, and on MPI,
the fixed cycle stays. A cycle the user set (HVDLITE_CYCLE_TIME or Horovod's
HOROVOD_CYCLE_TIME) is never changed.

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
    # This suite's ranks run on one host, each with the same affinity (mpiexec and
    # torchrun bind none): they share CPUs when there are more of them than CPUs.
    shared = hvd.local_size() > len(os.sched_getaffinity(0))
    longer = runtime.transport_name() == "gloo" and shared
    assert cycle == (defaults.GLOO_CYCLE_MS if longer else 1.0)
    reasons = runtime.engine().defaults_chosen
    assert any(r.startswith("HVDLITE_CYCLE_TIME=") for r in reasons) == longer
