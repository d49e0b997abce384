"""CUDA tensors through hvdlite.torch: every collective on the GPU through NCCL
and through the staged (pinned host) path, stream ordering, CPU/GPU mismatches,
and DistributedOptimizer and SyncBatchNorm equivalence on CUDA.

Needs a GPU and CuPy; elsewhere (CI) every test here skips with the reason.
Size-agnostic: one rank per GPU uses NCCL; ranks sharing a GPU use staging.
"""
from __future__ import annotations

import hashlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU here (GPU tests run on a GPU machine)", allow_module_level=True)
pytest.importorskip("cupy", reason="CUDA tensors need CuPy (pip install hvdlite[cuda13])")

import hvdlite as runtime_hvd  # noqa: E402
import hvdlite.torch as hvd  # noqa: E402
from hvdlite.api.control import reconfigure  # noqa: E402

TOLERANCE = 1e-10      # float64 models: only summation order differs


@pytest.fixture(scope="module", autouse=True)
def _pin_gpu() -> None:
    torch.cuda.set_device(hvd.local_device())


def _cuda(values: object, dtype: "torch.dtype" = torch.float32) -> "torch.Tensor":
    return torch.as_tensor(values, dtype=dtype).cuda()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16,
                                   torch.bfloat16, torch.int32, torch.int64])
def test_allreduce_on_gpu(gpu_path: str, dtype: "torch.dtype") -> None:
    rank, size = hvd.rank(), hvd.size()
    x = torch.full((1000,), rank + 1, dtype=dtype, device="cuda")
    total = hvd.allreduce(x, op=hvd.Sum, name=f"gpu.sum.{gpu_path}.{dtype}")
    assert total.is_cuda and total.dtype == dtype
    assert torch.equal(total.cpu(), torch.full((1000,), size * (size + 1) // 2, dtype=dtype))
    biggest = hvd.allreduce(x, op=hvd.Max, name=f"gpu.max.{gpu_path}.{dtype}")
    assert torch.equal(biggest.cpu(), torch.full((1000,), size, dtype=dtype))
    if dtype.is_floating_point:
        mean = hvd.allreduce(x, name=f"gpu.avg.{gpu_path}.{dtype}")
        assert torch.allclose(mean.float().cpu(), torch.full((1000,), (size + 1) / 2))


def test_fused_and_in_place_allreduce_on_gpu(gpu_path: str) -> None:
    rank, size = hvd.rank(), hvd.size()
    tensors = [torch.full((n,), float(rank), device="cuda") for n in (3, 70, 1 << 18)]
    strided = torch.full((8, 8), float(rank), device="cuda")[:, ::2]
    handles = [hvd.allreduce_async_(t, op=hvd.Sum, name=f"gpu.fused.{gpu_path}.{i}")
               for i, t in enumerate(tensors + [strided])]
    for handle in handles:
        hvd.synchronize(handle)
    expected = float(sum(range(size)))
    for tensor in tensors + [strided]:
        assert torch.all(tensor == expected), tensor


def test_data_movement_on_gpu(gpu_path: str) -> None:
    rank, size = hvd.rank(), hvd.size()
    rows = torch.full((rank + 1, 2), float(rank), device="cuda")
    gathered = hvd.allgather(rows, name=f"gpu.gather.{gpu_path}")
    expected = torch.cat([torch.full((r + 1, 2), float(r)) for r in range(size)])
    assert gathered.is_cuda and torch.equal(gathered.cpu(), expected)
    root = size - 1
    data = _cuda([rank, rank * 2, 7])
    assert torch.equal(hvd.broadcast(data, root, name=f"gpu.bcast.{gpu_path}").cpu(),
                       torch.tensor([root, root * 2, 7], dtype=torch.float32))
    splits = [(rank + dest) % 3 for dest in range(size)]
    sent = torch.arange(sum(splits), dtype=torch.float32, device="cuda") + 100 * rank
    received, counts = hvd.alltoall(sent, splits=splits, name=f"gpu.a2a.{gpu_path}")
    assert counts.tolist() == [(src + rank) % 3 for src in range(size)]
    assert received.is_cuda and received.numel() == sum(counts.tolist())
    scattered = hvd.reducescatter(torch.ones(2 * size + 1, 3, device="cuda"), op=hvd.Sum,
                                  name=f"gpu.rs.{gpu_path}")
    assert scattered.is_cuda and torch.all(scattered == size)
    assert scattered.shape[0] == 2 + (1 if rank == 0 else 0)


def test_a_group_of_more_tensors_than_one_nccl_group_call_takes(gpu_path: str) -> None:
    rank, size = hvd.rank(), hvd.size()
    tensors = [torch.full((3,), float(rank + i), device="cuda") for i in range(1500)]
    averaged = hvd.grouped_allreduce(tensors, name=f"gpu.many.{gpu_path}")
    expected = torch.tensor([(size - 1) / 2 + i for i in range(1500)], dtype=torch.float32)
    assert torch.allclose(torch.stack(averaged)[:, 0].cpu(), expected)
    assert all(t.is_cuda for t in averaged)


def test_gpu_traffic_is_counted(gpu_path: str) -> None:
    """NCCL and the staged path count their bytes (estimates) like the host backends."""
    size = hvd.size()
    before = runtime_hvd.traffic()
    hvd.allreduce(torch.ones(1024, device="cuda"), op=hvd.Sum, name=f"gpu.traffic.{gpu_path}")
    after = runtime_hvd.traffic()
    expected = 2 * 4096 * (size - 1) // size            # a ring's bytes each way
    assert (after["sent"] - before["sent"], after["received"] - before["received"]) == \
        (expected, expected)
    assert after["backends"].keys() & {"nccl", "staged"}


def test_collective_waits_for_work_queued_on_the_callers_stream() -> None:
    """The input is still being computed on a side stream when it is submitted: the
    engine's stream must wait for it, and the result must be usable there at once."""
    rank, size = hvd.rank(), hvd.size()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        a = torch.full((2048, 2048), 1.0 / 2048, device="cuda")
        for _ in range(20):
            a = a @ torch.ones(2048, 2048, device="cuda") / 2048    # slow, stays 1/2048
        x = a.sum(dim=0) * 0 + (rank + 1)
        total = hvd.allreduce(x, op=hvd.Sum, name="gpu.stream.order")
        doubled = total * 2                                          # on the side stream
    torch.cuda.synchronize()
    assert torch.all(doubled == size * (size + 1)), doubled[:4]


def test_cpu_and_gpu_tensors_under_one_name_mismatch_everywhere() -> None:
    if hvd.size() < 2:
        pytest.skip("needs two ranks")
    tensor = torch.ones(4, device="cuda" if hvd.rank() == 0 else "cpu")
    with pytest.raises(hvd.MismatchError, match="device"):
        hvd.allreduce(tensor, name="gpu.cpu.mix")
    after = hvd.allreduce(torch.ones(2, device="cuda"), op=hvd.Sum, name="gpu.after.mix")
    assert torch.all(after == hvd.size())


def _model() -> "torch.nn.Module":
    torch.manual_seed(7)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8),
                               torch.nn.ReLU(), torch.nn.Flatten(),
                               torch.nn.Linear(8 * 6 * 6, 4)).double().cuda()


def _batch(step: int) -> tuple["torch.Tensor", "torch.Tensor"]:
    generator = torch.Generator().manual_seed(500 + step)
    total = 4 * hvd.size()
    return (torch.randn(total, 3, 8, 8, generator=generator, dtype=torch.float64).cuda(),
            torch.randn(total, 4, generator=generator, dtype=torch.float64).cuda())


def _train(distributed: bool, steps: int = 5) -> "torch.nn.Module":
    model = _model()
    if distributed:
        model = hvd.SyncBatchNorm.convert_sync_batchnorm(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if distributed:
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for step in range(steps):
        x, y = _batch(step)
        if distributed:
            x, y = x[hvd.rank() * 4:(hvd.rank() + 1) * 4], y[hvd.rank() * 4:(hvd.rank() + 1) * 4]
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return model


def test_optimizer_and_sync_batch_norm_on_gpu_match_one_process(gpu_path: str) -> None:
    """N ranks on 1/N of each batch (SyncBatchNorm over the shards) reach the
    parameters and running statistics of one process with BatchNorm on the whole
    batch, within 1e-10 (float64), and hold bitwise-identical copies."""
    distributed, reference = _train(True), _train(False)
    for (name, mine), theirs in zip(distributed.state_dict().items(),
                                    reference.state_dict().values()):
        if mine.dtype.is_floating_point:
            assert torch.allclose(mine, theirs, atol=TOLERANCE, rtol=0), name
    digest = hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes()
                                     for p in distributed.parameters())).hexdigest()
    assert len(set(runtime_hvd.allgather_object(digest))) == 1
    assert np.isfinite([p.sum().item() for p in distributed.parameters()]).all()


@pytest.fixture
def multi_rank_path():  # type: ignore[no-untyped-def]
    """HVDLITE_ONE_RANK_SHORTCUT=0: on one GPU the optimizer still makes its buckets
    and reduces them through the engine and NCCL, as on several GPUs."""
    reconfigure(one_rank_shortcut=False)
    yield
    reconfigure(one_rank_shortcut=True)


def test_gradient_buckets_on_gpu_are_views_reduced_in_place(gpu_path: str,
                                                            multi_rank_path: None) -> None:
    """From the first step each CUDA .grad is a view of a CUDA bucket, and N ranks
    on 1/N of the batch reach one process's parameters (float64)."""
    def make() -> "torch.nn.Module":
        torch.manual_seed(5)
        return torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.Tanh(),
                                   torch.nn.Linear(32, 3)).double().cuda()
    model, reference = make(), make()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())
    plain = torch.optim.SGD(reference.parameters(), lr=0.1)
    batches = [torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(s))
               for s in range(3 * hvd.size())]
    for step in range(3):
        mine = batches[step * hvd.size() + hvd.rank()].cuda()
        optimizer.zero_grad()
        model(mine).pow(2).sum().backward()
        optimizer.step()
        plain.zero_grad()
        everyone = [batches[step * hvd.size() + r].cuda() for r in range(hvd.size())]
        (sum(reference(b).pow(2).sum() for b in everyone) / hvd.size()).backward()
        plain.step()
    flats = [b.flat for b in optimizer._reducer.buckets]
    assert all(f.is_cuda for f in flats)
    assert all(any(p.grad._base is f for f in flats) for p in model.parameters())
    for mine_p, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(mine_p, want, rtol=0, atol=TOLERANCE)
