"""Every collective against a NumPy reference (tests/differential.py), on every host
path (MPI, the ring, the parameter server) through the NumPy and torch bindings,
and on a GPU, where one is present, through NCCL and through the staged path.

Small fusion and direct thresholds put fusion, direct reduction and the ring's
chunking within reach of small tensors, so "above the fusion threshold" costs
little. The NCCL backend's multi-rank code runs on a CPU in tests/standin.
"""
from __future__ import annotations

import time
from typing import Any, Iterator

import numpy as np
import pytest

import hvdlite as hvd
from hvdlite.api import runtime
from hvdlite.api.adapter import NUMPY
from hvdlite.api.binding import make_ops
from hvdlite.api.control import reconfigure
from tests import differential
from tests.differential import Path

CASES = 300
REPRODUCE = "mpiexec -n {size} python tests/mpi/run.py tests/mpi/test_differential.py -k {path}"


@pytest.fixture(scope="module")
def evens() -> Iterator[Any]:
    with differential.even_ranks_and_small_thresholds() as subset:
        yield subset


def check(path: Path, subset: Any, drawn: list[differential.Case]) -> None:
    started = time.perf_counter()
    failures = differential.run_cases(
        path, drawn, subset, REPRODUCE.format(size=hvd.size(), path=path.name))
    seconds = time.perf_counter() - started
    if hvd.rank() == 0:
        print(f"\ndifferential {path.name}: {len(drawn)} cases, {len(failures)} wrong on rank 0, "
              f"{seconds:.1f} s")
    assert not failures, "\n".join(failures[:10])


def _numpy_path(name: str) -> Path:
    return Path(name, make_ops(NUMPY), lambda a: a.copy(), np.asarray)


@pytest.mark.parametrize("backend_name", ["mpi", "ring", "ps"])
def test_every_collective_matches_numpy_on_the_host(evens: Any, backend_name: str) -> None:
    previous = runtime.config().allreduce
    reconfigure(allreduce=backend_name)
    try:
        check(_numpy_path(backend_name), evens, differential.cases(CASES))
    finally:
        reconfigure(allreduce=previous)


def _torch_path(name: str, device: str) -> Path:
    torch = pytest.importorskip("torch")
    import hvdlite.torch as hvd_torch
    from hvdlite.torch.adapter import TorchAdapter

    def to_tensor(array: np.ndarray) -> Any:
        if array.dtype == differential.BF16:
            return torch.from_numpy(array.view(np.int16).copy()).view(torch.bfloat16).to(device)
        return torch.from_numpy(array.copy()).to(device)

    def to_numpy(tensor: Any) -> np.ndarray:
        tensor = tensor.detach().cpu()
        if tensor.dtype == torch.bfloat16:
            return tensor.view(torch.int16).numpy().view(differential.BF16)
        return tensor.numpy()
    assert hvd_torch.allreduce is not None
    return Path(name, make_ops(TorchAdapter()), to_tensor, to_numpy, host=device == "cpu")


def test_every_collective_matches_numpy_through_torch(evens: Any) -> None:
    check(_torch_path("torch", "cpu"), evens, differential.cases(CASES // 2))


@pytest.mark.parametrize("gpu_path", ["nccl", "mpi"])
def test_every_collective_matches_numpy_on_a_gpu(evens: Any, gpu_path: str) -> None:
    """CUDA tensors through NCCL ("nccl") and staged through the host ("mpi"); on
    a GPU machine only (one rank per GPU for NCCL; ranks sharing a GPU are staged)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU here: the GPU paths run on a GPU machine "
                    "(make gpu-check); tests/standin runs the NCCL code on the CPU")
    pytest.importorskip("cupy", reason="CUDA tensors need CuPy (pip install hvdlite[cuda13])")
    torch.cuda.set_device(hvd.local_device())
    previous = runtime.config().gpu_allreduce
    reconfigure(gpu_allreduce=gpu_path)
    try:
        check(_torch_path(f"cuda-{gpu_path}", "cuda"), evens, differential.cases(CASES))
    finally:
        reconfigure(gpu_allreduce=previous)
