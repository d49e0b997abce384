"""``python -m bench zero-memory``: memory per rank of ZeroRedundancyOptimizer against
DistributedOptimizer, AdamW on a model of about ``--params`` parameters (fp32 Linear
layers), each method in its own launch per world size: the optimizer state this rank
holds, and its peak resident memory above what it held before making the model (the
interpreter, torch, hvdlite), with the figures the design expects beside them.

Expected, per rank, for P parameters of 4 bytes, N ranks, the largest parameter L:
- DistributedOptimizer: parameters 4P, gradients 4P (its buckets), AdamW's two moments 8P,
  and during its step one temporary the size of the moments' square roots, 4P;
- ZeroRedundancyOptimizer: parameters 4P, gradients 4P (its flat buffer), this rank's
  averaged share of them 4P/N, moments 8P/N, the square roots 4P/N, and while a step runs
  three chunks of HVDLITE_BUCKET_BYTES: two being gathered, one the engine reduces from.
Both also hold for a moment the gradient autograd makes of one parameter, 4L, before it
is moved into place; the rest of the peak (the first backward's own buffers) is alike.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from typing import Sequence

from bench.launches import mpiexec_path

METHODS = ("distributed", "zero")
MIB = 1 << 20
WIDTH = 4096                  # one layer: 16.8 M parameters


def worker(argv: Sequence[str]) -> None:
    """Rank 0 prints ``RESULT {json}``: the largest rank's state and peak memory."""
    import torch
    import hvdlite.torch as hvd
    parser = argparse.ArgumentParser()
    parser.add_argument("--method", choices=METHODS, required=True)
    parser.add_argument("--params", type=float, required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    hvd.init()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # torch, hvdlite
    layers = max(1, round(args.params / (WIDTH * WIDTH + WIDTH)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
    if args.method == "zero":
        optimizer = hvd.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-4)
        state_of = optimizer.local_optimizer.state
    else:
        adamw = torch.optim.AdamW(model.parameters(), lr=1e-4)
        optimizer = hvd.DistributedOptimizer(adamw, named_parameters=model.named_parameters())
        state_of = adamw.state
    x = torch.randn(2, WIDTH)
    for _ in range(3):
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()
    state = sum(v.numel() * v.element_size() for s in state_of.values() for v in s.values()
                if torch.is_tensor(v) and v.dim() > 0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    mine = {"state": state, "peak": peak}
    every = hvd.allgather_object(mine)
    if hvd.rank() == 0:
        params = sum(p.numel() for p in model.parameters())
        largest = max(p.numel() for p in model.parameters())
        print("RESULT " + json.dumps({"params": params, "largest": largest,
                                      "state": max(e["state"] for e in every),
                                      "peak": max(e["peak"] for e in every)}), flush=True)
    hvd.shutdown()


def _launch(np_: int, method: str, params: float) -> dict:
    command = [mpiexec_path(), "-n", str(np_), sys.executable, "-m", "bench",
               "zero-memory-worker", "--method", method, "--params", str(params)]
    done = subprocess.run(command, capture_output=True, text=True, check=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def expected(method: str, params: int, largest: int, np_: int,
             chunk_bytes: int) -> tuple[float, float]:
    """(state, peak) in bytes that the design expects, as the module's docstring says."""
    zero = method == "zero"
    share = 1 / np_ if zero else 1
    state = 8 * params * share
    extra = 4 * params / np_ + 3 * chunk_bytes if zero else 0
    return state, 8 * params + state + 4 * params * share + 4 * largest + extra


def main(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench zero-memory",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--np", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--params", type=float, default=100e6)
    args = parser.parse_args(argv)
    from hvdlite.config import Config
    chunk_bytes = Config.load().bucket_bytes
    print("| np | method | parameters | state/rank MiB | expected | peak RSS/rank MiB "
          "above start | expected |")
    print("|---|---|---|---|---|---|---|")
    for np_ in args.np:
        for method in METHODS:
            print(f"np={np_} {method} ...", file=sys.stderr, flush=True)
            got = _launch(np_, method, args.params)
            state, peak = expected(method, got["params"], got["largest"], np_, chunk_bytes)
            print(f"| {np_} | {method} | {got['params'] / 1e6:.1f} M | {got['state'] / MIB:,.0f} "
                  f"| {state / MIB:,.0f} | {got['peak'] / MIB:,.0f} | {peak / MIB:,.0f} |",
                  flush=True)
