"""Data-parallel training of a small CNN on scikit-learn's bundled digits data
set (8x8 images, no download) with hvdlite.torch.

    mpiexec -n 2 python examples/pytorch_digits.py
    mpiexec -n 2 python examples/pytorch_digits.py --local-sgd 4

A Horovod script ported by changing one import line: init, shard the data by
rank, scale the learning rate by the number of ranks, broadcast the initial
state from rank 0, wrap the optimizer, and average metrics across ranks.
``--local-sgd PERIOD`` trains with local SGD instead (hvdlite beyond Horovod): each
rank steps on its own gradients and the models are averaged every PERIOD steps.
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from tqdm import tqdm

import hvdlite.torch as hvd


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = torch.nn.Linear(32 * 4 * 4, 64)
        self.fc2 = torch.nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def load(seed: int) -> tuple[TensorDataset, TensorDataset]:
    digits = load_digits()
    images = torch.tensor(digits.images / 16.0, dtype=torch.float32).unsqueeze(1)
    labels = torch.tensor(digits.target)
    x_train, x_test, y_train, y_test = train_test_split(
        images, labels, test_size=0.25, random_state=seed, stratify=labels)
    return TensorDataset(x_train, y_train), TensorDataset(x_test, y_test)


def average(value: float, name: str) -> float:
    """The mean of a metric over ranks."""
    return hvd.allreduce(torch.tensor(value, dtype=torch.float64), name=name).item()


def evaluate(model: torch.nn.Module, test_set: TensorDataset) -> float:
    """Accuracy on the whole test set: each rank scores its own slice, then the
    correct and total counts are summed across ranks (exact, no padding)."""
    x, y = test_set.tensors
    mine = slice(hvd.rank(), None, hvd.size())
    model.eval()
    with torch.no_grad():
        correct = (model(x[mine]).argmax(1) == y[mine]).sum()
    counts = hvd.allreduce(torch.tensor([float(correct), float(len(y[mine]))]), op=hvd.Sum,
                           name="accuracy.counts")
    return (counts[0] / counts[1]).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.02, help="per rank; scaled by size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--local-sgd", type=int, default=0, metavar="PERIOD",
                        help="average the models every PERIOD steps instead of the "
                             "gradients every step (0: DistributedOptimizer)")
    parser.add_argument("--losses", metavar="FILE",
                        help="rank 0 writes every step's loss, averaged over ranks, as JSON")
    args = parser.parse_args()

    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)                   # one core per rank
    train_set, test_set = load(args.seed)
    sampler = DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank(),
                                 shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)

    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    if args.local_sgd:
        optimizer = hvd.PostLocalSGDOptimizer(optimizer, hvd.PeriodicModelAverager(args.local_sgd))
    else:
        optimizer = hvd.DistributedOptimizer(optimizer,
                                             named_parameters=model.named_parameters())
    losses = []

    start = time.perf_counter()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)               # a different shuffle every epoch
        model.train()
        total, batches = 0.0, 0
        # Rank 0 only; None lets tqdm switch itself off when stderr is not a terminal.
        bar = tqdm(loader, desc=f"epoch {epoch + 1}/{args.epochs}", leave=False,
                   disable=True if hvd.rank() != 0 else None)
        for x, y in bar:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            total, batches = total + loss.item(), batches + 1
            if args.losses:
                losses.append(average(loss.item(), "step_loss"))
            bar.set_postfix(loss=f"{loss.item():.3f}")
        train_loss = average(total / batches, "train_loss")
        accuracy = evaluate(model, test_set)
        if hvd.rank() == 0:
            print(f"epoch {epoch + 1:2d}  train loss {train_loss:.4f}  test accuracy "
                  f"{accuracy:.4f}", flush=True)
    if args.losses and hvd.rank() == 0:
        with open(args.losses, "w") as out:
            json.dump(losses, out)
    if hvd.rank() == 0:
        print(f"{hvd.size()} ranks, {args.epochs} epochs in {time.perf_counter() - start:.1f} s: "
              f"test accuracy {accuracy:.4f}", flush=True)


if __name__ == "__main__":
    main()
