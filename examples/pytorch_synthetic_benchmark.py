"""Synthetic-data training throughput, with the command line of Horovod's
pytorch_synthetic_benchmark.py (models are defined here: torchvision has no
CPU wheel on this machine). Trains on the local GPU where there is one.

    mpiexec -n 2 python examples/pytorch_synthetic_benchmark.py --model cnn
"""
from __future__ import annotations

import argparse
import timeit

import numpy as np
import torch
import torch.nn.functional as F

import hvdlite.torch as hvd


class _Block(torch.nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(channels)
        self.conv2 = torch.nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


def build(name: str) -> tuple[torch.nn.Module, tuple[int, ...]]:
    """A model and its per-sample input shape."""
    if name == "mlp":
        return torch.nn.Sequential(torch.nn.Linear(784, 1024), torch.nn.ReLU(),
                                   torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                                   torch.nn.Linear(1024, 1000)), (784,)
    if name == "cnn":
        return torch.nn.Sequential(
            torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Flatten(), torch.nn.Linear(64 * 8 * 8, 256), torch.nn.ReLU(),
            torch.nn.Linear(256, 1000)), (3, 32, 32)
    if name == "resnet8":
        return torch.nn.Sequential(
            torch.nn.Conv2d(3, 32, 3, padding=1, bias=False), torch.nn.BatchNorm2d(32),
            torch.nn.ReLU(), _Block(32), _Block(32), _Block(32), torch.nn.AdaptiveAvgPool2d(1),
            torch.nn.Flatten(), torch.nn.Linear(32, 1000)), (3, 32, 32)
    raise SystemExit(f"unknown --model {name!r}; choose mlp, cnn or resnet8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--fp16-allreduce", action="store_true", default=False,
                        help="use fp16 compression during allreduce")
    parser.add_argument("--model", type=str, default="cnn", help="mlp, cnn or resnet8")
    parser.add_argument("--batch-size", type=int, default=32, help="input batch size")
    parser.add_argument("--num-warmup-batches", type=int, default=10,
                        help="number of warm-up batches that don't count towards benchmark")
    parser.add_argument("--num-batches-per-iter", type=int, default=10,
                        help="number of batches per benchmark iteration")
    parser.add_argument("--num-iters", type=int, default=10, help="number of benchmark iterations")
    parser.add_argument("--no-cuda", action="store_true", default=False,
                        help="train on the CPU even where a GPU is available")
    parser.add_argument("--use-adasum", action="store_true", default=False,
                        help="reduce with Adasum instead of averaging (CPU tensors only)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = parser.parse_args()

    hvd.init()
    cuda = not args.no_cuda and torch.cuda.is_available()
    if args.use_adasum and cuda:
        raise SystemExit("hvdlite's Adasum reduces CPU tensors only; add --no-cuda")
    if cuda:
        torch.cuda.set_device(hvd.local_device())    # one rank per GPU
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, shape = build(args.model)
    device = torch.device("cuda" if cuda else "cpu")
    model.to(device)
    # Adasum combines gradients without averaging them: no learning-rate scaling.
    optimizer = torch.optim.SGD(model.parameters(),
                                lr=0.01 * (1 if args.use_adasum else hvd.size()))
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression,
                                         op=hvd.Adasum if args.use_adasum else hvd.Average)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    data = torch.randn(args.batch_size, *shape, device=device)
    target = torch.randint(0, 1000, (args.batch_size,), device=device)

    def benchmark_step() -> None:
        optimizer.zero_grad()
        F.cross_entropy(model(data), target).backward()
        optimizer.step()

    def log(text: str) -> None:
        if hvd.rank() == 0:
            print(text, flush=True)

    log(f"Model: {args.model}\nBatch size: {args.batch_size}\nNumber of ranks: {hvd.size()} "
        f"({'GPU' if cuda else f'CPU, {args.threads} thread(s)'} each)")
    log("Running warmup...")
    timeit.timeit(benchmark_step, number=args.num_warmup_batches)
    log("Running benchmark...")
    rates = []
    for iteration in range(args.num_iters):
        elapsed = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
        rate = args.batch_size * args.num_batches_per_iter / elapsed
        log(f"Iter #{iteration}: {rate:.1f} img/sec per rank")
        rates.append(rate)
    mean, conf = np.mean(rates), 1.96 * np.std(rates)
    log(f"Img/sec per rank: {mean:.1f} +-{conf:.1f}")
    log(f"Total img/sec on {hvd.size()} rank(s): {hvd.size() * mean:.1f} +-{hvd.size() * conf:.1f}")


if __name__ == "__main__":
    main()
