"""Multi-rank data-parallel least squares on NumPy: every rank computes the
gradient on its shard, hvdlite averages it, all ranks take the same step.

    mpiexec -n 2 python examples/numpy_allreduce.py
"""
from __future__ import annotations

import argparse
import hashlib
import time

import numpy as np

import hvdlite as hvd


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.02)
    args = parser.parse_args()

    hvd.init()
    rng = np.random.default_rng(0)            # same data set on every rank...
    true_w = rng.normal(size=args.features)
    x = rng.normal(size=(args.samples, args.features))
    y = x @ true_w + 0.01 * rng.normal(size=args.samples)
    shard = slice(hvd.rank(), None, hvd.size())   # ...each rank trains on its shard
    x_local, y_local = x[shard], y[shard]

    w = np.random.default_rng(1000 + hvd.rank()).normal(size=args.features)
    w = hvd.broadcast(w, root_rank=0, name="w0")  # start from rank 0's weights
    if hvd.rank() == 0:
        print(f"initial loss {float(np.mean((x @ w - y) ** 2)):.4f}", flush=True)
    start = time.perf_counter()
    for step in range(args.steps):
        grad = 2 * x_local.T @ (x_local @ w - y_local) / len(y_local)
        w -= args.lr * hvd.allreduce(grad, name="grad")
        if hvd.rank() == 0 and (step % 50 == 0 or step == args.steps - 1):
            loss = float(np.mean((x @ w - y) ** 2))
            print(f"step {step:4d}  loss {loss:.6f}", flush=True)
    elapsed = time.perf_counter() - start
    digest = hvd.allgather_object(hashlib.sha256(w.tobytes()).hexdigest())
    if hvd.rank() == 0:
        error = float(np.linalg.norm(w - true_w))
        print(f"{hvd.size()} ranks, {args.steps} steps in {elapsed:.2f} s; "
              f"|w - w_true| = {error:.4f}; parameters identical on all ranks: "
              f"{len(set(digest)) == 1}")
    hvd.shutdown()


if __name__ == "__main__":
    main()
