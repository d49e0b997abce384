"""CUDA tensors under torchrun: over torch's own NCCL (hvdlite/backends/torch_nccl.py)
where each rank has a GPU of its own, staged through the host and Gloo where ranks
share one; every collective against the NumPy reference on both paths.

Needs a GPU, CuPy and a torchrun launch (``make gpu-check`` runs it at world size 1,
NCCL, and 2, two ranks on one GPU); elsewhere every test skips, saying why. The
same code at 2 and 4 ranks runs on the CPU stand-in in every CI run
(tests/standin, under torchrun in make test-gloo).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU here (GPU tests run on a GPU machine)", allow_module_level=True)
pytest.importorskip("cupy", reason="CUDA tensors need CuPy (pip install hvdlite[cuda13])")

import hvdlite.torch as hvd  # noqa: E402
from hvdlite.api import runtime  # noqa: E402
from hvdlite.api.control import reconfigure  # noqa: E402
from tests import differential  # noqa: E402
from tests.mpi.test_differential import _torch_path, check  # noqa: E402

if runtime.transport_name() != "gloo":
    pytest.skip("launched by MPI: these tests are torchrun's (make gpu-check runs both)",
                allow_module_level=True)

CASES = 300


@pytest.fixture(scope="module", autouse=True)
def _pin_gpu() -> None:
    torch.cuda.set_device(hvd.local_device())


def _shares_a_gpu() -> bool:
    return hvd.local_size() > torch.cuda.device_count()


def _torch_nccl() -> Any:
    return runtime.engine().executor.chain.backend("torch-nccl")


def test_cuda_tensors_take_torchs_nccl_unless_ranks_share_a_gpu() -> None:
    """The global set's group (read from the backend: what ran is the point) is a
    ProcessGroupNCCL of every rank, or none where two ranks share a GPU."""
    rank, size = hvd.rank(), hvd.size()
    total = hvd.allreduce(torch.full((33,), rank + 1.0, device="cuda"), op=hvd.Sum,
                          name="torchrun.which")
    assert torch.equal(total.cpu(), torch.full((33,), size * (size + 1) / 2))
    group = _torch_nccl()._comms[0]
    if _shares_a_gpu():
        assert group is None
    else:
        assert type(group).__name__ == "ProcessGroupNCCL" and group.size() == size
    before = hvd.traffic()["backends"]["torch-nccl"]["kinds"]["allreduce"]["calls"]
    hvd.allreduce(torch.ones(5, device="cuda"), name="torchrun.which.again")
    assert hvd.traffic()["backends"]["torch-nccl"]["kinds"]["allreduce"]["calls"] == before + 1


def test_every_collective_matches_numpy(gpu_path: str) -> None:
    with differential.even_ranks_and_small_thresholds() as evens:
        check(_torch_path(f"torchrun-cuda-{gpu_path}", "cuda"), evens, differential.cases(CASES))


@pytest.mark.parametrize("n", [0, 1, 17, 4913, 1_048_579])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_average_is_right_to_the_last_element_in_and_out_of_place(
        gpu_path: str, n: int, dtype: Any) -> None:
    """The lengths whose tail NCCL's own Average left unwritten out of place on one rank;
    the outputs first hold other values (a freed result of 7s)."""
    rank, size = hvd.rank(), hvd.size()
    tag = f"{gpu_path}.{n}.{dtype}"
    stale = hvd.allreduce(torch.full((n,), 7.0, dtype=dtype, device="cuda"), name=f"stale.{tag}")
    del stale        # its memory may be what the next output is made of
    expected = torch.full((n,), (size + 1) / 2, dtype=dtype)
    out = hvd.allreduce(torch.full((n,), rank + 1.0, dtype=dtype, device="cuda"),
                        name=f"avg.{tag}")
    assert torch.equal(out.cpu(), expected)
    inplace = torch.full((n,), rank + 1.0, dtype=dtype, device="cuda")
    hvd.allreduce_(inplace, name=f"avg_.{tag}")
    assert torch.equal(inplace.cpu(), expected)


def test_distributed_optimizer_on_cuda_keeps_ranks_bitwise_identical(gpu_path: str) -> None:
    """A few steps of a small model, each rank on its own batch: every rank ends with
    the same parameters, bit for bit, and one process on the whole batch reaches them
    within float64 summation-order error."""
    size, rank = hvd.size(), hvd.rank()
    reconfigure(one_rank_shortcut=False)      # at world size 1 too: buckets over torch's NCCL
    try:
        _train_and_compare(size, rank)
    finally:
        reconfigure(one_rank_shortcut=True)


def _train_and_compare(size: int, rank: int) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 1)).double().cuda()
    alone = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 1)).double().cuda()
    alone.load_state_dict(model.state_dict())
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())
    single = torch.optim.SGD(alone.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(4 * size, 8, generator=generator, dtype=torch.float64).cuda()
        y = torch.randn(4 * size, 1, generator=generator, dtype=torch.float64).cuda()
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x[4 * rank: 4 * rank + 4]),
                                     y[4 * rank: 4 * rank + 4]).backward()
        optimizer.step()
        single.zero_grad()
        torch.nn.functional.mse_loss(alone(x), y).backward()
        single.step()
    mine = torch.cat([p.detach().flatten() for p in model.parameters()]).cpu()
    every = hvd.allgather_object(mine.numpy().tobytes())
    assert all(each == every[0] for each in every)
    reference = torch.cat([p.detach().flatten() for p in alone.parameters()]).cpu()
    np.testing.assert_allclose(mine.numpy(), reference.numpy(), rtol=0, atol=1e-12)
