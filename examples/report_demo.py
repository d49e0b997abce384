"""Make the HVDLITE_REPORT shown in the docs (docs/guide/performance.md): train an MLP
on synthetic data and write report.txt, report.json and report.png.

    mpiexec -n 4 python examples/report_demo.py --report /tmp/balanced
    mpiexec -n 4 python examples/report_demo.py --report docs/images/report --slow-rank 3 \
        --delay-ms 100 --steps 60

The second is the docs' picture (make docs-images runs it).

``--slow-rank R`` makes rank R's data loading ``--delay-ms`` slower each step, the
commonest cause of a straggler. Run it on a quiet machine: the report measures
time, and shared cores make every rank look slow at random.
"""
from __future__ import annotations

import argparse
import os
import time

import torch

import hvdlite.torch as hvd


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--report", default="report", help="directory for the report")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=64, help="samples per rank and step")
    parser.add_argument("--slow-rank", type=int, default=-1)
    parser.add_argument("--delay-ms", type=float, default=40.0)
    args = parser.parse_args()
    os.environ["HVDLITE_REPORT"] = args.report   # read by init(); hvdliterun --report sets it
    hvd.init()
    torch.manual_seed(hvd.rank())
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(784, 1024), torch.nn.ReLU(),
                                torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                                torch.nn.Linear(1024, 10))
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                         named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for _ in range(args.steps):
        if hvd.rank() == args.slow_rank:
            time.sleep(args.delay_ms / 1e3)              # a slow data loader
        x, y = torch.randn(args.batch, 784), torch.randint(0, 10, (args.batch,))
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    hvd.shutdown()       # rank 0 gathers every rank's record and writes the report


if __name__ == "__main__":
    main()
