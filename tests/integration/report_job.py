"""A small torch training run for the HVDLITE_REPORT tests: every rank "loads data"
(sleeps REPORT_BASE_SLEEP seconds) each step, and rank REPORT_SLOW_RANK sleeps
REPORT_EXTRA_SLEEP more; compute is tiny, so the sleeps dominate even on an
overloaded machine."""
from __future__ import annotations

import os
import time

import torch

import hvdlite.torch as hvd


def main() -> None:
    hvd.init()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    steps = int(os.environ.get("REPORT_STEPS", "25"))
    slow = int(os.environ.get("REPORT_SLOW_RANK", "-1"))
    base = float(os.environ.get("REPORT_BASE_SLEEP", "0.02"))
    extra = float(os.environ.get("REPORT_EXTRA_SLEEP", "0.06"))
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                         named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for _ in range(steps):
        time.sleep(base + (extra if hvd.rank() == slow else 0.0))   # data loading
        x = torch.randn(16, 32)
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        hvd.allreduce(loss.detach(), name="loss")    # a metric: an 'other' collective
    hvd.shutdown()


if __name__ == "__main__":
    main()
