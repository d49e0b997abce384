"""Running the GPU backends without a GPU, for tests/unit/test_gpu_backends.py and
test_gpu_staged.py: hvdlite/backends/{cuda,staged,nccl,gpu}.py imported afresh
under tests/unit/fake_cupy.py and fake_nccl.py, every rank a thread over
tests/unit/fake_comm.py as its MPI, on a fake GPU of its own (or a shared one).
Values are small integers, exact in every dtype and order of reduction."""
from __future__ import annotations

import importlib
import sys
from types import SimpleNamespace
from typing import Any, Callable

import ml_dtypes
import numpy as np
import pytest

import hvdlite.backends
from hvdlite.backends import ring as ring_backend
from hvdlite.config import Config
from hvdlite.reduce_op import ReduceOp
from hvdlite.transport.mpi_transport import MpiTransport
from tests.unit import fake_cupy
from tests.unit.fake_comm import FAKE_MPI, ThreadComm, run_ranks

SET = 5
SIZES = [1, 2, 3, 4]
BF16 = np.dtype(ml_dtypes.bfloat16)
F16, F32 = np.dtype(np.float16), np.dtype(np.float32)
ELEMENTWISE = [ReduceOp.SUM, ReduceOp.AVERAGE, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT]
REDUCE = {ReduceOp.SUM: np.sum, ReduceOp.AVERAGE: np.sum, ReduceOp.MIN: np.min,
          ReduceOp.MAX: np.max, ReduceOp.PRODUCT: np.prod}    # Average: a sum, divided later
DTYPES = [F32, F16, BF16, np.dtype(np.float64), np.dtype(np.int32), np.dtype(np.int64),
          np.dtype(np.uint8), np.dtype(np.int8)]
MODULES = ("cuda", "staged", "gpu_sets", "nccl", "torch_nccl", "gpu")


def loader(monkeypatch: pytest.MonkeyPatch) -> Callable[..., SimpleNamespace]:
    """``load(nccl_version)`` imports the six modules afresh under a fresh fake CuPy
    (None: a CuPy without NCCL); sys.modules and hvdlite.backends get their own
    entries back after the test, so nothing of the fake outlives it."""
    monkeypatch.setattr(ring_backend, "MPI", FAKE_MPI)      # the ring's Waitall

    def load(nccl_version: int | None = 21805) -> SimpleNamespace:
        cupy = fake_cupy.install(monkeypatch, nccl_version)
        for name in MODULES:
            full = f"hvdlite.backends.{name}"
            monkeypatch.setitem(sys.modules, full, None)     # put back (or removed) after
            del sys.modules[full]
            monkeypatch.setattr(hvdlite.backends, name, None, raising=False)
        modules = {name: importlib.import_module(f"hvdlite.backends.{name}") for name in MODULES}
        return SimpleNamespace(cupy=cupy, **modules)
    return load


def on_gpus(size: int, work: Callable[[ThreadComm], Any],
            device: Callable[[int], int] = lambda rank: rank) -> list[Any]:
    """``work(comm)`` on every rank, each rank's thread on GPU ``device(rank)``."""
    def rank_main(comm: ThreadComm) -> Any:
        fake_cupy.Device(device(comm.Get_rank())).use()
        return work(comm)
    return run_ranks(size, rank_main)


def contribution(rank: int, n: int, dtype: Any, op: ReduceOp = ReduceOp.SUM,
                 scale: int = 1) -> np.ndarray:
    """Small integers, different per rank (products of at most 4 stay at most 16)."""
    if op is ReduceOp.PRODUCT:
        values = 1 + (np.arange(n) + rank) % 2
    else:
        values = (np.arange(n) * (rank + 3)) % 7 - 3 + rank
        if np.dtype(dtype).kind == "u":
            values = values + 3
    return (values * scale).astype(dtype)


def reduced(size: int, n: int, dtype: Any, op: ReduceOp, scale: int = 1) -> np.ndarray:
    stack = np.stack([contribution(r, n, dtype, op, scale).astype(np.float64)
                      for r in range(size)])
    return REDUCE[op](stack, axis=0).astype(dtype)


def widened_size(dtype: np.dtype) -> int:
    """Bytes per element the staged backend reduces in (half types as float32)."""
    return 4 if dtype in (F16, BF16) else dtype.itemsize


def config(**settings: Any) -> Config:
    return Config.load({}, **settings)


def opened(factory: Any, comm: ThreadComm, **settings: Any) -> Any:
    backend = factory(config(**settings))
    backend.open_set(SET, MpiTransport(comm))
    return backend


def moved(backend: Any, kind: str) -> tuple[int, int]:
    counts = backend.traffic.snapshot()[kind]
    return counts["sent"], counts["received"]


def nccl_calls(stream: Any) -> list[tuple]:
    return [entry for entry in stream.log if entry[0] == "nccl"]
