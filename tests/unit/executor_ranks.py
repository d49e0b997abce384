"""Running the executor without MPI processes, for test_executor.py and
test_executor_runs.py: every rank of a set is a thread running its own Executor
over tests/unit/fake_comm.py, with the real MPI, ring and parameter-server
backends (found necessary by make mutate on hvdlite/engine/executor.py: each of
its mutants cost an mpiexec run, hours for the module). Responses and requests
are built as the engine builds them: the response carries the coordinator's
(rank 0's) descriptor, a rank that has joined has no request."""
from __future__ import annotations

from typing import Any, Callable, Optional

import ml_dtypes
import numpy as np
import pytest

from hvdlite.backends import ps as ps_backend
from hvdlite.backends import ring as ring_backend
from hvdlite.config import Config
from hvdlite.engine.executor import Executor
from hvdlite.negotiation.requests import Descriptor, Kind, ReduceOp, Request, Response
from hvdlite.transport.mpi_transport import MpiTransport
from tests.unit.fake_comm import FAKE_MPI, ThreadComm, run_ranks

SET = 3                      # not set 0: the executor must use the id it is given
SIZES = [1, 2, 3, 4]
UFUNCS = {ReduceOp.SUM: np.add, ReduceOp.AVERAGE: np.add, ReduceOp.MIN: np.minimum,
          ReduceOp.MAX: np.maximum, ReduceOp.PRODUCT: np.multiply}
BF16 = np.dtype(ml_dtypes.bfloat16)
WIDE = {np.dtype(np.float16): np.dtype(np.float32), BF16: np.dtype(np.float32)}


def fake_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ring and the server wait on requests through ``MPI.Request.Waitall``
    (each test module calls this from an autouse fixture)."""
    monkeypatch.setattr(ring_backend, "MPI", FAKE_MPI)
    monkeypatch.setattr(ps_backend, "MPI", FAKE_MPI)


# --- building what the engine hands the executor ---------------------------------------

def contribution(rank: int, shape: tuple[int, ...], dtype: Any, salt: int = 0) -> np.ndarray:
    """Small signed integers (exact in any order of reduction), different per rank."""
    n = int(np.prod(shape, dtype=np.int64))
    values = (np.arange(n) * (rank + 3 + salt)) % 7 - 3 + rank
    return values.astype(dtype).reshape(shape)


def desc(name: str, kind: Kind, array: np.ndarray, **fields: Any) -> Descriptor:
    return Descriptor(name, kind, dtype=array.dtype.name if array.dtype != BF16 else "bfloat16",
                      shape=array.shape, **fields)


def allreduce(name: str, array: np.ndarray, op: ReduceOp = ReduceOp.SUM, *,
              inplace: bool = False, **fields: Any) -> Request:
    output = array if inplace else np.empty_like(array)
    return Request(desc(name, Kind.ALLREDUCE, array, op=int(op), **fields), SET, array, output)


def expected(arrays: list[Optional[np.ndarray]], like: np.ndarray, op: ReduceOp,
             prescale: float = 1.0, postscale: float = 1.0) -> np.ndarray:
    """What every rank must get: contributions widened, prescaled, reduced in rank
    order over the ranks that have not joined (``None``), divided (Average, by the
    set's size: joined ranks count) and postscaled."""
    wide = WIDE.get(like.dtype, like.dtype)
    parts = [a.astype(wide) for a in arrays if a is not None]
    for part in parts:
        if prescale != 1.0:
            np.multiply(part, prescale, out=part, casting="unsafe")
    total = parts[0].copy()
    for part in parts[1:]:
        UFUNCS[op](total, part, out=total)
    if op is ReduceOp.AVERAGE:
        np.true_divide(total, len(arrays), out=total, casting="unsafe")
    if postscale != 1.0:
        np.multiply(total, postscale, out=total, casting="unsafe")
    return total.astype(like.dtype)


class Ranks:
    """One Executor per rank, each recording what it completed and which backend
    calls it made."""

    def __init__(self, comm: ThreadComm, **settings: Any) -> None:
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.completed: list[tuple[Request, Any]] = []
        self.executor = Executor(Config.load({}, **settings),
                                 lambda request, result: self.completed.append((request, result)),
                                 lambda: None)
        self.executor.open_set(SET, MpiTransport(comm))
        self.calls: list[tuple[str, str]] = []
        self._depth = 0
        for backend in self.executor.chain.every_backend():
            for kind in ("allreduce", "allreduce_from", "allgather", "broadcast", "alltoall",
                         "reducescatter"):
                if hasattr(backend, kind):
                    setattr(backend, kind, self._spy(backend.name, kind, getattr(backend, kind)))

    def _spy(self, name: str, kind: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if not self._depth:                 # the executor's calls, not a backend's own
                self.calls.append((name, kind))
            self._depth += 1
            try:
                return method(*args, **kwargs)
            finally:
                self._depth -= 1
        return call

    def run(self, requests: list[Optional[Request]], responses: list[Response],
            plan_key: Any = None) -> dict[str, Any]:
        """Run agreed responses with this rank's requests (None: not submitted here);
        the results completed, by name."""
        self.completed.clear()
        pending = {r.desc.name: r for r in requests if r is not None}
        self.executor.run(SET, responses, pending, plan_key)
        assert not self.executor.busy
        results = {r.desc.name: result for r, result in self.completed}
        assert len(results) == len(self.completed) == len(pending)   # each once, all of them
        assert all(r is pending[r.desc.name] for r, _ in self.completed)
        return results


def on_ranks(size: int, steps: Callable[[Ranks], Any], **settings: Any) -> list[Any]:
    return run_ranks(size, lambda comm: steps(Ranks(comm, **settings)))


def responses_for(make: Callable[[int], list[Request]], joined: tuple[int, ...] = ()
                  ) -> list[Response]:
    """The agreed responses: rank 0's descriptors (the coordinator's view)."""
    return [Response(r.desc, joined=joined) for r in make(0)]
