"""The GPU backends at np=2 and np=4 on the CPU stand-in: every collective against
the NumPy reference (tests/differential.py) through NCCL (each rank on a "GPU" of
its own) and through the staged path, with joined ranks, process sets and group
calls; the NCCL code is shown to have run.

Run: mpiexec -n 2 python tests/mpi/run.py tests/standin (and -n 4), and under torchrun
(python -m torch.distributed.run --standalone --nproc_per_node=2 tests/mpi/run.py
tests/standin), where the NCCL path is torch's (hvdlite/backends/torch_nccl.py, on Gloo
here) and the staged one moves the host copy over Gloo.
"""
from __future__ import annotations

import time
from typing import Any, Iterator

import numpy as np
import pytest

import hvdlite as hvd
from hvdlite.api import runtime
from hvdlite.api.binding import make_ops
from tests import differential
from tests.differential import Path
from tests.standin import gpu_standin
from tests.unit import fake_nccl

CASES = 300
REPRODUCE = "mpiexec -n {size} python tests/mpi/run.py tests/standin -k {path}"
OPS = make_ops(gpu_standin.StandInAdapter())
cupy = gpu_standin.install()       # the conftest's modules, already installed


@pytest.fixture(scope="module", autouse=True)
def evens() -> Iterator[Any]:
    """This rank on "GPU" local_rank; the even ranks' process set; small thresholds."""
    gpu_standin.use_device(hvd.local_rank())
    with differential.even_ranks_and_small_thresholds() as subset:
        yield subset


def device_path(name: str) -> Path:
    return Path(name, OPS, lambda array: cupy.asarray(array), lambda tensor: tensor.get(),
                host=False)


def _torch_nccl_calls() -> int:
    kinds = hvd.traffic()["backends"].get("torch-nccl", {}).get("kinds", {})
    return sum(kind["calls"] for kind in kinds.values())


def test_every_collective_matches_numpy_on_the_device(evens: Any, gpu_path: str) -> None:
    launches, torch_calls = len(fake_nccl.state().groups), _torch_nccl_calls()
    started = time.perf_counter()
    name = f"standin-{gpu_path}-{runtime.transport_name()}"
    failures = differential.run_cases(device_path(name), differential.cases(CASES), evens,
                                      REPRODUCE.format(size=hvd.size(), path=gpu_path))
    if hvd.rank() == 0:
        print(f"\ndifferential {name}: {CASES} cases, {len(failures)} wrong on rank 0, "
              f"{time.perf_counter() - started:.1f} s")
    assert not failures, "\n".join(failures[:10])
    nccl_launches = len(fake_nccl.state().groups) - launches
    torch_moved = _torch_nccl_calls() - torch_calls
    on_mpi = runtime.transport_name() == "mpi"
    if gpu_path == "nccl" and on_mpi:
        assert nccl_launches > CASES // 2, "the NCCL backend was not used"
    elif gpu_path == "nccl":       # torchrun: torch's NCCL (Gloo here), never CuPy's
        assert nccl_launches == 0 and torch_moved > 0, "the torch-nccl backend was not used"
    else:
        assert nccl_launches == 0 and torch_moved == 0, "the staged path called NCCL"


@pytest.mark.parametrize("n", [1, 17, 4913, 1_048_579])
def test_average_out_of_place_on_the_device_is_right_to_the_last_element(
        gpu_path: str, n: int) -> None:
    """The shapes whose tail NCCL's ncclAvg left stale on a GPU (at one rank: the
    stand-in models it), with the output first filled with other values."""
    rank, size = hvd.rank(), hvd.size()
    for dtype in (np.float16, np.float32, np.float64):
        x = cupy.asarray(np.full(n, rank + 1, dtype))
        stale = OPS["allreduce"](cupy.asarray(np.full(n, 7, dtype)), op=hvd.Sum,
                                 name=f"stale.{gpu_path}.{n}.{np.dtype(dtype).name}")
        del stale        # its memory may be what the next output is made of
        mean = OPS["allreduce"](x, op=hvd.Average,
                                name=f"avg.{gpu_path}.{n}.{np.dtype(dtype).name}").get()
        np.testing.assert_array_equal(mean, np.full(n, (size + 1) / 2, dtype))
    grouped = OPS["grouped_allreduce"](
        [cupy.asarray(np.full(m, rank + 1, np.float32)) for m in differential.GROUP],
        op=hvd.Average, name=f"grouped.avg.{gpu_path}.{n}")
    for m, result in zip(differential.GROUP, grouped):
        np.testing.assert_array_equal(result.get(), np.full(m, (size + 1) / 2, np.float32))


def test_allreduce_with_a_joined_rank_on_the_device(gpu_path: str) -> None:
    """The last rank joins at once: it adds zeros, and Average divides by the size."""
    rank, size = hvd.rank(), hvd.size()
    if rank == size - 1:
        assert hvd.join() in range(size)
        return
    for n, dtype in ((1, np.float32), (17, np.float64), (4913, np.int32), (33, np.float16)):
        total = OPS["allreduce"](cupy.asarray(np.full(n, rank + 1, dtype)), op=hvd.Sum,
                                 name=f"join.sum.{gpu_path}.{n}").get()
        np.testing.assert_array_equal(total, np.full(n, (size - 1) * size // 2, dtype))
        if np.dtype(dtype).kind == "f":
            mean = OPS["allreduce"](cupy.asarray(np.full(n, rank + 1, dtype)),
                                    name=f"join.avg.{gpu_path}.{n}").get()
            np.testing.assert_allclose(mean, np.full(n, (size - 1) * size / 2 / size, dtype))
    hvd.join()


def test_a_group_on_two_devices_is_refused_on_every_rank() -> None:
    """Horovod's test_horovod_grouped_allreduce_cpu_gpu_error, on devices 0 and 1."""
    arrays = []
    for device in (hvd.local_rank(), hvd.local_rank() + 1):
        gpu_standin.use_device(device)
        arrays.append(cupy.asarray(np.ones(10, np.float32)))
    gpu_standin.use_device(hvd.local_rank())
    with pytest.raises(hvd.UsageError, match="cuda:.*cuda:"):
        OPS["grouped_allreduce"](arrays, op=hvd.Sum, name="two.devices")
    after = OPS["allreduce"](cupy.asarray(np.ones(3, np.float32)), op=hvd.Sum, name="after")
    np.testing.assert_array_equal(after.get(), np.full(3, hvd.size(), np.float32))
