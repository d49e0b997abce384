"""Parameter server against ring: bytes moved per rank, measured and predicted.

    mpiexec -n 4 python -m bench traffic [--mib 4] [--json]

For one float32 buffer of N bytes it runs an allreduce with ``ps``, ``ring`` and
MPI's own ``MPI_Allreduce`` (time only: MPI chooses its algorithm) and reads the
byte counters (``hvd.traffic()``) on every rank. "Per rank" is the busiest
rank: for the parameter server that is the server (the set's rank 0), which
sends and receives N(P-1) bytes while each worker moves N each way; the ring
moves 2N(P-1)/P on every rank. The counts must equal the formulas exactly.

It then prints, for P = 2 to 512, the predicted bytes per rank and a
latency-bandwidth (alpha-beta) time model at ``--bandwidth`` GB/s per link and
``--latency`` us per message:

    ps:   2 (P-1) (alpha + N/B)      the server takes P-1 messages in, then sends P-1 out
    ring: 2 (P-1) (alpha + N/(P B))  2(P-1) steps of N/P bytes on every link at once

(At P = 2 both move N bytes each way per rank, yet the ring is modelled twice
as fast: its two ranks send at the same time, while the server's push and pull
phases follow each other.)

and writes a plot of both (``--plot``; matplotlib Agg). The formulas are the
scaling forecast's (``python -m hvdlite.forecast``), written once there.
"""
from __future__ import annotations

import argparse
import json
from typing import Any, Sequence

import numpy as np
from mpi4py import MPI

import hvdlite as hvd
from hvdlite.api.control import reconfigure
from hvdlite.diagnostics import scaling_model
from hvdlite.diagnostics.scaling_model import formula_bytes
from bench.timing import seconds_per_call

ALGORITHMS = ("ps", "ring", "mpi")
FORMULAS = {"ps": "N(P-1) at the server (workers: N)", "ring": "2N(P-1)/P on every rank",
            "mpi": "not counted (MPI's own algorithm)"}


def model_seconds(algorithm: str, nbytes: int, size: int, bandwidth: float,
                  latency: float) -> float:
    """The alpha-beta model above (bandwidth in bytes/s, latency in seconds): the
    scaling forecast's allreduce cost (hvdlite/diagnostics/scaling_model.py), one message."""
    cost = scaling_model.allreduce_cost(algorithm, size,
                                        scaling_model.Link("given", bandwidth, latency))
    return cost.latency + cost.per_byte * nbytes


def _counted(algorithm: str) -> tuple[int, int]:
    kinds = hvd.traffic()["backends"][algorithm]["kinds"].get("allreduce", {})
    return kinds.get("sent", 0), kinds.get("received", 0)


def measure(algorithm: str, nbytes: int, seconds: float, comm: MPI.Comm) -> dict[str, Any]:
    """One row: the busiest rank's bytes for one allreduce, and the slowest rank's time."""
    reconfigure(allreduce=algorithm)
    buf = np.zeros(nbytes // 4, dtype=np.float32)   # zeros: repeated sums stay finite
    name = f"bench.traffic.{algorithm}"
    hvd.allreduce_(buf, op=hvd.Sum, name=name)       # warm-up: scratch buffers, cache
    before = _counted(algorithm)
    hvd.allreduce_(buf, op=hvd.Sum, name=name)
    after = _counted(algorithm)
    moved = comm.allgather((after[0] - before[0], after[1] - before[1]))
    elapsed = seconds_per_call(lambda: hvd.allreduce_(buf, op=hvd.Sum, name=name), seconds, comm)
    exact = algorithm != "mpi"
    return {"algorithm": algorithm, "np": comm.Get_size(), "nbytes": nbytes,
            "sent_per_rank": max(s for s, _ in moved) if exact else None,
            "received_per_rank": max(r for _, r in moved) if exact else None,
            "sent_least_rank": min(s for s, _ in moved) if exact else None,
            "time_s": elapsed, "formula_bytes": formula_bytes(algorithm, nbytes, comm.Get_size()),
            "formula": FORMULAS[algorithm]}


def _measured_table(rows: Sequence[dict[str, Any]]) -> str:
    lines = [f"Measured: one allreduce of N = {rows[0]['nbytes']} bytes on P = {rows[0]['np']} "
             "ranks (bytes of the busiest rank; time of the slowest)",
             f"{'algorithm':>9} | {'sent':>12} | {'received':>12} | {'formula':>12} | "
             f"{'match':>5} | {'time':>10} | formula"]
    for row in rows:
        cells = [row[k] for k in ("sent_per_rank", "received_per_rank", "formula_bytes")]
        match = "-" if cells[0] is None else (
            "yes" if cells[0] == cells[1] == cells[2] else "NO")
        text = [("-" if c is None else str(c)).rjust(12) for c in cells]
        lines.append(f"{row['algorithm']:>9} | " + " | ".join(text) +
                     f" | {match:>5} | {row['time_s'] * 1e3:7.3f} ms | {row['formula']}")
    return "\n".join(lines)


def model_rows(nbytes: int, bandwidth: float, latency: float,
               sizes: Sequence[int]) -> list[dict[str, Any]]:
    return [{"np": p, "ps_bytes": formula_bytes("ps", nbytes, p),
             "ring_bytes": formula_bytes("ring", nbytes, p),
             "ps_s": model_seconds("ps", nbytes, p, bandwidth, latency),
             "ring_s": model_seconds("ring", nbytes, p, bandwidth, latency)} for p in sizes]


def _model_table(rows: Sequence[dict[str, Any]], nbytes: int, bandwidth: float,
                 latency: float) -> str:
    lines = [f"\nPredicted for N = {nbytes} bytes at {bandwidth / 1e9:g} GB/s per link, "
             f"{latency * 1e6:g} us per message",
             f"{'P':>4} | {'ps bytes (server)':>18} | {'ring bytes/rank':>16} | "
             f"{'ps time':>11} | {'ring time':>11} | ps / ring"]
    for row in rows:
        lines.append(f"{row['np']:>4} | {row['ps_bytes']:>18} | {row['ring_bytes']:>16} | "
                     f"{row['ps_s'] * 1e3:8.3f} ms | {row['ring_s'] * 1e3:8.3f} ms | "
                     f"{row['ps_s'] / row['ring_s']:8.1f}x")
    return "\n".join(lines)


def plot(model: Sequence[dict[str, Any]], measured: Sequence[dict[str, Any]], path: str,
         nbytes: int, bandwidth: float) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, ax = plt.subplots(figsize=(7, 4.5))
    sizes = [row["np"] for row in model]
    for key, label in (("ps_s", "parameter server (model)"), ("ring_s", "ring (model)")):
        ax.plot(sizes, [row[key] * 1e3 for row in model], marker="o", label=label)
    for row in measured:
        ax.scatter([row["np"]], [row["time_s"] * 1e3], marker="x", s=60, zorder=3,
                   label=f"{row['algorithm']} measured here")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("ranks P")
    ax.set_ylabel("time per allreduce (ms)")
    ax.set_title(f"Allreduce of {nbytes / (1 << 20):g} MiB at {bandwidth / 1e9:g} GB/s per link")
    ax.legend(fontsize="small")
    ax.grid(True, which="both", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench traffic",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=float, default=4.0, help="buffer size N (MiB)")
    parser.add_argument("--bandwidth", type=float, default=10.0, help="link GB/s for the model")
    parser.add_argument("--latency", type=float, default=5.0, help="us per message for the model")
    parser.add_argument("--max-p", type=int, default=512, help="largest P in the model table")
    parser.add_argument("--seconds", type=float, default=0.3, help="timed loop per algorithm")
    parser.add_argument("--plot", default="traffic.png", help="where rank 0 writes the plot")
    parser.add_argument("--json", action="store_true", help="print only the measured rows")
    args = parser.parse_args(argv)
    hvd.init()
    comm = MPI.COMM_WORLD.Dup()            # the timing loop's barriers
    size = comm.Get_size()
    # Whole float32 elements, divisible by P: the formulas are then exact integers.
    nbytes = max(4 * size, int(args.mib * (1 << 20)) // (4 * size) * (4 * size))
    rows = [measure(a, nbytes, args.seconds, comm) for a in ALGORITHMS]
    reconfigure(allreduce="auto")
    bandwidth, latency = args.bandwidth * 1e9, args.latency * 1e-6
    sizes = [1 << k for k in range(1, args.max_p.bit_length()) if 1 << k <= args.max_p]
    model = model_rows(nbytes, bandwidth, latency, sizes)
    if hvd.rank() == 0:
        if args.json:
            print(json.dumps(rows), flush=True)
        else:
            print(_measured_table(rows) + "\n" + _model_table(model, nbytes, bandwidth, latency),
                  flush=True)
        try:
            plot(model, rows, args.plot, nbytes, bandwidth)
            if not args.json:
                print(f"\nplot: {args.plot}", flush=True)
        except ImportError:
            if not args.json:
                print("\nno plot: matplotlib is not installed (pip install 'hvdlite[report]')")
    hvd.shutdown()
