"""Training throughput: hvdlite's DistributedOptimizer against torch DDP over gloo
and a hand-fused mpi4py loop, measured in the same processes, same run.

    python -m hvdlite.bench training          # runs np=1 and np=2 itself, prints the table

One thread per rank (torch.set_num_threads(1)). Samples/s counts the global
batch (per-rank batch x ranks) over timed steps after warm-up.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Callable, Sequence

from hvdlite.bench.timing import seconds_per_call

MODELS = ("mlp", "cnn")
METHODS = ("hvdlite", "ddp_gloo", "hand_fused")


def _build(name: str):  # type: ignore[no-untyped-def]
    import torch
    torch.manual_seed(0)
    if name == "mlp":
        model = torch.nn.Sequential(torch.nn.Linear(784, 1024), torch.nn.ReLU(),
                                    torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                                    torch.nn.Linear(1024, 10))
        return model, (torch.randn(64, 784), torch.randint(0, 10, (64,)))
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(64 * 8 * 8, 256), torch.nn.ReLU(),
        torch.nn.Linear(256, 10))
    return model, (torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,)))


def _timed_steps(step: Callable[[], None], seconds: float, comm) -> float:  # type: ignore[no-untyped-def]
    """Training steps per second on the slowest rank."""
    return 1.0 / seconds_per_call(step, seconds, comm, warmup=5, min_calls=10)


def _loop(model, optimizer, data, backward_hook: Callable[[], None] = lambda: None):  # type: ignore[no-untyped-def]
    import torch
    x, y = data

    def step() -> None:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        backward_hook()
        optimizer.step()
    return step


def _run_hand_fused(name: str, comm, seconds: float) -> float:  # type: ignore[no-untyped-def]
    import numpy as np
    import torch
    from mpi4py import MPI
    model, data = _build(name)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    params = list(model.parameters())
    flat = np.empty(sum(p.numel() for p in params), dtype=np.float32)

    def fused_allreduce() -> None:      # after backward: one fused Allreduce, then average
        torch.cat([p.grad.reshape(-1) for p in params], out=torch.from_numpy(flat))
        comm.Allreduce(MPI.IN_PLACE, flat, op=MPI.SUM)
        np.divide(flat, comm.Get_size(), out=flat)
        offset = 0
        for p in params:
            p.grad.copy_(torch.from_numpy(flat[offset:offset + p.numel()]).view_as(p))
            offset += p.numel()
    return _timed_steps(_loop(model, optimizer, data, fused_allreduce), seconds, comm)


def _run_ddp(name: str, comm, seconds: float) -> float:  # type: ignore[no-untyped-def]
    import torch
    import torch.distributed as dist
    port = comm.bcast(29500 + os.getpid() % 2000 if comm.Get_rank() == 0 else None, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=comm.Get_rank(), world_size=comm.Get_size())
    try:
        model, data = _build(name)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
        return _timed_steps(_loop(ddp, optimizer, data), seconds, comm)
    finally:
        dist.destroy_process_group()


def _run_hvdlite(name: str, comm, seconds: float) -> float:  # type: ignore[no-untyped-def]
    import torch
    import hvdlite.torch as hvd
    hvd.init()
    try:
        model, data = _build(name)
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                             named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        return _timed_steps(_loop(model, optimizer, data), seconds, comm)
    finally:
        hvd.shutdown()


def worker(argv: Sequence[str]) -> None:
    """Runs under mpiexec; rank 0 prints one JSON line of samples/s."""
    import torch
    from mpi4py import MPI
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD.Dup()
    runners = {"hvdlite": _run_hvdlite, "ddp_gloo": _run_ddp, "hand_fused": _run_hand_fused}
    batch = {"mlp": 64, "cnn": 32}
    best: dict[str, float] = {}
    for _ in range(args.rounds):            # interleave methods; keep each one's best round
        for model in MODELS:
            for method in METHODS:
                rate = runners[method](model, comm, args.seconds) * batch[model] * comm.Get_size()
                key = f"{model}/{method}"
                best[key] = max(best.get(key, 0.0), rate)
                if comm.Get_rank() == 0 and args.verbose:
                    print(f"{key}: {rate:.0f}", file=sys.stderr, flush=True)
    if comm.Get_rank() == 0:
        print("RESULT " + json.dumps({"np": comm.Get_size(), "samples_per_s": best}), flush=True)


def main(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m hvdlite.bench training",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--np", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--seconds", type=float, default=3.0, help="timed loop per cell")
    args = parser.parse_args(argv)
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    results = []
    for np_ in args.np:
        print(f"running np={np_} ...", file=sys.stderr, flush=True)
        out = subprocess.run([mpiexec, "-n", str(np_), sys.executable, "-m", "hvdlite.bench",
                              "training-worker", "--seconds", str(args.seconds)],
                             capture_output=True, text=True, check=True).stdout
        line = next(l for l in out.splitlines() if l.startswith("RESULT "))
        results.append(json.loads(line[len("RESULT "):]))
    print("\nTraining throughput, samples/s (global batch; one thread per rank; best of 3 "
          "interleaved rounds)")
    print(f"{'model':>5} {'np':>3} | {'hvdlite':>9} {'DDP gloo':>9} {'hand-fused':>10} | "
          f"{'vs DDP':>7} {'vs hand-fused':>13}")
    for result in results:
        for model in MODELS:
            rates = [result["samples_per_s"][f"{model}/{m}"] for m in METHODS]
            print(f"{model:>5} {result['np']:>3} | {rates[0]:9.0f} {rates[1]:9.0f} {rates[2]:10.0f}"
                  f" | {rates[0] / rates[1]:6.2f}x {rates[0] / rates[2]:12.2f}x")
