"""A ZeroRedundancyOptimizer (AdamW) under hvd.elastic.run, committing every step to
HVDLITE_ELASTIC_DIR; a job resumed from that commit at another world size reshards
the optimizer state. Each step's whole batch (8 rows) is split among the ranks, so
every world size trains on the same data.

Environment (test settings, not hvdlite knobs):
  ZERO_STOP   the step to stop at (its commit is the last); the job then ends
  ZERO_OUT    rank 0 writes the parameters here (JSON), with the world size and the
              step it resumed from
"""
from __future__ import annotations

import json
import os

import torch

import hvdlite.torch as hvd

ROWS = 8


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(900 + step)
    return (torch.randn(ROWS, 6, generator=generator, dtype=torch.float64),
            torch.randn(ROWS, 2, generator=generator, dtype=torch.float64))


def main() -> None:
    hvd.init()
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(6, 13), torch.nn.Tanh(),
                                torch.nn.Linear(13, 2)).double()
    optimizer = hvd.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW,
                                            lr=0.02, weight_decay=0.1)
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, step=0)
    stop = int(os.environ["ZERO_STOP"])
    resumed_from = []

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        resumed_from.append(state.step)
        per = ROWS // hvd.size()
        while state.step < stop:
            x, y = _batch(state.step)
            rows = slice(hvd.rank() * per, (hvd.rank() + 1) * per)
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
            optimizer.step()
            state.step += 1
            state.commit()

    train(state)
    if hvd.rank() == 0:
        with open(os.environ["ZERO_OUT"], "w") as out:
            json.dump({"size": hvd.size(), "resumed_from": resumed_from[0],
                       "parameters": [p.detach().reshape(-1).tolist()
                                      for p in model.parameters()]}, out)
    hvd.shutdown()


if __name__ == "__main__":
    main()
