"""GPU benchmark: CUDA-tensor allreduce through hvdlite's NCCL and staged paths
against torch.distributed's NCCL, and the training step of a small ResNet with
hvdlite's DistributedOptimizer against plain torch and DDP.

    mpiexec -n 1 python -m bench gpu        # world size 1, one GPU
    torchrun --nproc_per_node=1 -m bench gpu   # the same under torchrun

Every figure is the median over interleaved rounds (each round times every
method once, in turn), with the spread (min-max) beside it.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any, Callable, Optional, Sequence

# torch.distributed's NCCL group of the baselines (DDP, dist.all_reduce): the default group
# under MPI (None), one of its own under torchrun, where hvdlite's default group is Gloo.
_BASELINE_GROUP: Optional[Any] = None


def _median_spread(samples: Sequence[float]) -> str:
    return f"{statistics.median(samples) * 1e3:9.3f} ms ({min(samples) * 1e3:.3f}-{max(samples) * 1e3:.3f})"


def _per_call(step: Callable[[], None], calls: int) -> float:
    import torch
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls


def _allreduce_table(rounds: int) -> None:
    import torch
    import torch.distributed as dist

    import hvdlite.torch as hvd
    from hvdlite.api.control import reconfigure
    print("\nAllreduce of a CUDA float32 tensor, in place, world size "
          f"{hvd.size()}: time per op, median (min-max) of {rounds} rounds")
    print(f"{'size':>9} | {'hvdlite nccl':>30} | {'hvdlite staged':>30} | {'torch.distributed nccl':>30}")
    for shift in range(12, 29, 2):                   # 4 KiB .. 256 MiB
        nbytes = 1 << shift
        buf = torch.zeros(nbytes // 4, device="cuda")
        calls = max(3, min(200, (64 << 20) // nbytes))
        methods: dict[str, Callable[[], None]] = {
            "nccl": lambda: hvd.allreduce_(buf, op=hvd.Sum, name="bench.gpu"),
            "staged": lambda: hvd.allreduce_(buf, op=hvd.Sum, name="bench.gpu"),
            "torch": lambda: dist.all_reduce(buf, group=_BASELINE_GROUP)}
        samples: dict[str, list[float]] = {k: [] for k in methods}
        for _ in range(rounds):
            for key, step in methods.items():
                if key != "torch":
                    reconfigure(gpu_allreduce="nccl" if key == "nccl" else "mpi")
                step()                                   # warm-up
                samples[key].append(_per_call(step, calls))
        size = f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"
        print(f"{size:>9} | " + " | ".join(f"{_median_spread(samples[k]):>30}" for k in methods),
              flush=True)
    reconfigure(gpu_allreduce="nccl")
    _many_small(rounds)


def _many_small(rounds: int, count: int = 200) -> None:
    """Per-tensor overhead: ``count`` async 4 KiB allreduces, then wait for all."""
    import torch
    import torch.distributed as dist

    import hvdlite.torch as hvd
    tensors = [torch.ones(1024, device="cuda") for _ in range(count)]

    def hvdlite_many() -> None:
        handles = [hvd.allreduce_async_(t, op=hvd.Sum, name=f"bench.gpu.many.{i}")
                   for i, t in enumerate(tensors)]
        for handle in handles:
            hvd.synchronize(handle)

    def hvdlite_grouped() -> None:
        hvd.synchronize(hvd.grouped_allreduce_async_(tensors, op=hvd.Sum,
                                                     name="bench.gpu.grouped"))

    def torch_many() -> None:
        for work in [dist.all_reduce(t, async_op=True, group=_BASELINE_GROUP)
                     for t in tensors]:
            work.wait()
    methods = {"hvdlite, one by one": hvdlite_many, "hvdlite, grouped": hvdlite_grouped,
               "torch.distributed nccl": torch_many}
    samples: dict[str, list[float]] = {key: [] for key in methods}
    for _ in range(rounds):
        for key, step in methods.items():
            step()
            samples[key].append(_per_call(step, 10))
    print(f"\n{count} async 4 KiB allreduces of CUDA tensors, then wait for all:")
    for key in methods:
        print(f"{key:>24} | {_median_spread(samples[key])}")


def _resnet() -> "object":
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, channels: int) -> None:
            super().__init__()
            self.body = nn.Sequential(
                nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels),
                nn.ReLU(), nn.Conv2d(channels, channels, 3, padding=1, bias=False),
                nn.BatchNorm2d(channels))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(x + self.body(x))

    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(), Block(64), Block(64),
                         nn.MaxPool2d(2), Block(64), Block(64), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(64, 10)).cuda()


def _workload(name: str) -> tuple[Callable[[], Any], Callable[[Any], Any], str]:
    """(make the model, its loss, a description) for the training table."""
    import torch
    if name == "resnet":
        x = torch.randn(128, 3, 32, 32, device="cuda")
        y = torch.randint(0, 10, (128,), device="cuda")
        return (_resnet, lambda model: torch.nn.functional.cross_entropy(model(x), y),
                "ResNet (4 blocks, 64 channels), batch 128 of 32x32")
    from bench import models
    _, (ids, targets) = models.build("transformer")
    ids, targets = ids.cuda(), targets.cuda()
    return (lambda: models.build("transformer")[0].cuda(),
            lambda model: models.loss("transformer", model, (ids, targets)),
            "GPT-style decoder (150 tensors, 11.6 M parameters), 8 sequences of 64 tokens")


def _training_table(rounds: int, steps: int, name: str) -> None:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    import hvdlite.torch as hvd
    make, loss, described = _workload(name)

    def stepper(kind: str) -> Callable[[], None]:
        model = make()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        if kind.startswith("hvdlite"):
            optimizer = hvd.DistributedOptimizer(optimizer,
                                                 named_parameters=model.named_parameters())
        elif kind == "ddp":
            model = DistributedDataParallel(model, device_ids=[torch.cuda.current_device()],
                                            process_group=_BASELINE_GROUP)

        def step() -> None:
            optimizer.zero_grad()
            loss(model).backward()
            optimizer.step()
        return step

    from hvdlite.api.control import reconfigure
    steppers = {kind: stepper(kind) for kind in ("torch", "hvdlite", "hvdlite-nccl", "ddp")}
    samples: dict[str, list[float]] = {k: [] for k in steppers}
    for _ in range(rounds):
        for kind, step in steppers.items():
            # hvdlite-nccl: HVDLITE_ONE_RANK_SHORTCUT=0, so on one rank every gradient
            # still goes through the engine, the buckets and NCCL, as on several GPUs.
            reconfigure(one_rank_shortcut=kind != "hvdlite-nccl")
            step()
            samples[kind].append(_per_call(step, steps))
    reconfigure(one_rank_shortcut=True)
    base = statistics.median(samples["torch"])
    print(f"\nTraining step, {described}, world size {hvd.size()}: median (min-max) of "
          f"{rounds} rounds (hvdlite-nccl: every gradient bucket through the engine and NCCL, "
          "the one-rank shortcut off)")
    for kind in steppers:
        median = statistics.median(samples[kind])
        print(f"{kind:>12} | {_median_spread(samples[kind])} | {median / base - 1:+7.1%} vs plain torch")


def main(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench gpu")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    import torch
    import torch.distributed as dist

    import hvdlite.torch as hvd
    hvd.init()
    torch.cuda.set_device(hvd.local_device())
    global _BASELINE_GROUP
    if dist.is_initialized():          # torchrun: hvdlite's transport made the Gloo default
        _BASELINE_GROUP = dist.new_group(backend="nccl")
    else:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("nccl", rank=hvd.rank(), world_size=hvd.size())
    transport = "torchrun (gloo)" if hvd.gloo_enabled() else "mpi"
    print(f"hvdlite GPU benchmark: {torch.cuda.get_device_name()}, nccl_built="
          f"{hvd.nccl_built()}, {hvd.size()} rank(s), transport {transport}")
    _allreduce_table(args.rounds)
    for name in ("resnet", "transformer"):
        _training_table(args.rounds, args.steps, name)
    if _BASELINE_GROUP is None:
        dist.destroy_process_group()
