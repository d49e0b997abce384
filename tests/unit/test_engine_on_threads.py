"""Whole engines on the in-process transport (tests/unit/fake_transport.py): several
ranks' engines in one process, negotiating, reducing and failing together with no
MPI communicator anywhere, which only a complete transport seam allows. The host
backends run on the transport's ``native`` ThreadComm (HVDLITE_ALLREDUCE=mpi: MPI's
own collectives, which that fake computes with NumPy)."""
from __future__ import annotations

from typing import Any

import pytest

from hvdlite.config import Config
from hvdlite.engine.engine import Engine
from hvdlite.errors import MismatchError
from tests.unit.engine_rig import QUIET, allreduce
from tests.unit.fake_transport import ThreadTransport, run_transports

pytestmark = pytest.mark.timeout(120)


def _engine(t: ThreadTransport) -> Engine:
    engine = Engine(Config(**{**QUIET, "allreduce": "mpi"}), t)
    engine.start()
    return engine


@pytest.mark.parametrize("size", [1, 3])
def test_engines_on_threads_agree_and_reduce(size: int) -> None:
    def steps(t: ThreadTransport) -> Any:
        engine = _engine(t)
        try:
            handles = [engine.submit(allreduce(f"grad.{i}", values=(t.rank + 1.0, float(i))))
                       for i in range(3)]
            return engine.topology, [engine.handles.wait(h).tolist() for h in handles]
        finally:
            engine.shutdown()
    results = run_transports(size, steps)
    total = size * (size + 1) / 2
    for rank, (topology, values) in enumerate(results):
        assert (topology.rank, topology.size, topology.local_size) == (rank, size, size)
        assert values == [[total, float(i) * size] for i in range(3)]


def test_a_shape_that_differs_between_ranks_fails_every_rank_alike() -> None:
    def steps(t: ThreadTransport) -> str:
        engine = _engine(t)
        try:
            values = (1.0, 2.0, 3.0) if t.rank == 1 else (1.0, 2.0)
            with pytest.raises(MismatchError) as caught:
                engine.handles.wait(engine.submit(allreduce("odd", values=values)))
            ok = engine.handles.wait(engine.submit(allreduce("after", values=(1.0,))))
            assert ok.tolist() == [float(t.size)]          # the engine goes on
            return str(caught.value)
        finally:
            engine.shutdown()
    messages = run_transports(3, steps)
    for rank, message in enumerate(messages):
        assert message.startswith(f"rank {rank}: ") and "'odd'" in message
