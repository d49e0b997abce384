"""Picklable Python objects over the tensor collectives, plus runtime queries."""
from __future__ import annotations

import importlib.util
import pickle
from typing import Any, Optional

import numpy as np

from hvdlite.api import collectives, runtime, submission
from hvdlite.api.adapter import NUMPY
from hvdlite.api.process_set import ProcessSet
from hvdlite.recording.timeline import Timeline


def _broadcast(array: np.ndarray, root_rank: int, name: str, process_set: Optional[ProcessSet]) -> Any:
    return submission.synchronize(collectives.broadcast_async(NUMPY, array, root_rank, name,
                                                               process_set))


def _allgather(array: np.ndarray, name: str, process_set: Optional[ProcessSet]) -> Any:
    return submission.synchronize(collectives.allgather_async(NUMPY, array, name, process_set))


def _base_name(kind: str, name: Optional[str], process_set: Optional[ProcessSet]) -> str:
    if name:
        return name
    set_id, _ = submission.set_ranks(process_set)
    return runtime.next_name(set_id, kind)[0]


def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None,
                     process_set: Optional[ProcessSet] = None) -> Any:
    """Return ``root_rank``'s ``obj`` on every rank of the set (pickled; ``root_rank``
    is a global rank, as in Horovod)."""
    base = _base_name("broadcast_object", name, process_set)
    _, ranks = submission.set_ranks(process_set)
    is_root = runtime.rank() == root_rank
    payload = np.frombuffer(pickle.dumps(obj), dtype=np.uint8) if is_root else None
    length = np.array([payload.size if is_root else 0], dtype=np.int64)
    length = _broadcast(length, root_rank, f"{base}.len", process_set)
    data = payload if is_root else np.empty(int(length[0]), dtype=np.uint8)
    data = _broadcast(data, root_rank, f"{base}.data", process_set)
    return obj if is_root else pickle.loads(data.tobytes())


def allgather_object(obj: Any, name: Optional[str] = None,
                     process_set: Optional[ProcessSet] = None) -> list[Any]:
    """Every rank's ``obj``, as a list in rank order."""
    base = _base_name("allgather_object", name, process_set)
    payload = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
    sizes = _allgather(np.array([payload.size], dtype=np.int64), f"{base}.len", process_set)
    data = _allgather(payload, f"{base}.data", process_set)
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    return [pickle.loads(data[bounds[i]:bounds[i + 1]].tobytes()) for i in range(len(sizes))]


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start writing a Chrome trace on rank 0 (other ranks: no-op), replacing the one
    being written; ``mark_cycles`` adds a CYCLE_START event per engine cycle."""
    engine = runtime.engine("hvdlite.start_timeline()")
    if runtime.rank() == 0:
        if engine.timeline is not None:
            engine.timeline.close()
        engine.timeline = Timeline(file_path, mark_cycles=mark_cycles)


def stop_timeline() -> None:
    engine = runtime.engine("hvdlite.stop_timeline()")
    timeline, engine.timeline = engine.timeline, None
    if timeline is not None:
        timeline.close()


def mpi_built() -> bool:
    """Whether mpi4py, MPI's transport, is installed."""
    return importlib.util.find_spec("mpi4py") is not None


def mpi_enabled() -> bool:
    """Whether hvdlite runs on MPI: its transport, or the one init() would open."""
    name = runtime.transport_name()
    return name == "mpi" if name is not None else mpi_built()


def gloo_built() -> bool:
    """True where hvdlite runs on Gloo: torch.distributed's transport, opened under
    torchrun; under MPI, False."""
    return runtime.transport_name() == "gloo"


def gloo_enabled() -> bool:
    """True where hvdlite runs on Gloo (under torchrun), False under MPI."""
    return runtime.transport_name() == "gloo"


def ddl_built() -> bool:
    """False: IBM's DDL is not supported."""
    return False


def rocm_built() -> bool:
    """False: hvdlite's GPU path (CuPy and NCCL) is built and tested for CUDA only."""
    return False


def ccl_built() -> bool:
    return False


def nccl_built() -> bool:
    """True where GPU tensors use NCCL: CuPy and its NCCL binding load, or under torchrun,
    CuPy (which CUDA tensors cross as) and torch's own NCCL."""
    if importlib.util.find_spec("cupy") is None:
        return False
    if runtime.transport_name() == "gloo":
        import torch.distributed
        return bool(torch.distributed.is_nccl_available())
    try:
        from cupy.cuda import nccl
        return nccl.get_version() > 0
    except Exception:       # no NCCL library, or no CUDA driver on this machine
        return False


def cuda_built() -> bool:
    """True where CuPy can reach a GPU (GPU tensors are then supported)."""
    if importlib.util.find_spec("cupy") is None:
        return False
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:       # CuPy without a driver or a GPU
        return False
