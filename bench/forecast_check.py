"""The forecast on this machine: from a one-rank run, forecast two ranks, then measure them.

    python -m bench forecast-check [--models mlp transformer] [--rounds 3]

1. The link: ``bench traffic`` at np=2 times hvdlite's ring on buffers of --mib sizes;
   a least-squares fit of t = 2(P-1) alpha + 2(P-1)/P N/B gives this machine's alpha
   and B. The forecast's communication time with them is then set against the ring's
   measured time at np=2 (the fit's own residual) and at np=4 (a prediction).
2. Each model of ``bench training`` (any name its MODELS has) runs once on one rank
   with HVDLITE_REPORT; the forecast reads that report.json and predicts samples/s on
   two ranks; then two ranks run, timed and recorded too. Rounds interleave the one-rank
   and two-rank launches; the table gives medians, their spread and the error, and splits
   it: the forecast again with the compute two ranks really had (on a small shared host
   ranks slow each other's compute, which the model does not have), and the exposed
   communication forecast against the one the two-rank report measured.

Each launch is its own mpiexec (bench/launches.py); progress goes to stderr.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any, Sequence

from hvdlite.diagnostics import scaling_model as model
from bench import launches, training


def traffic_rows(np_: int, mib: float, seconds: float, scratch: str) -> list[dict[str, Any]]:
    """One ``bench traffic --json`` launch: its measured rows."""
    command = [launches.mpiexec_path(), "-n", str(np_), sys.executable, "-m", "bench",
               "traffic", "--json", "--mib", str(mib), "--seconds", str(seconds), "--plot",
               os.path.join(scratch, "traffic.png")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600,
                          stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise RuntimeError(f"bench traffic at np={np_} failed:\n{done.stdout}\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def ring_times(np_: int, sizes_mib: Sequence[float], seconds: float,
               scratch: str) -> dict[int, float]:
    """Bytes -> the slowest rank's seconds per ring allreduce, at ``np_`` ranks."""
    times = {}
    for mib in sizes_mib:
        row = next(r for r in traffic_rows(np_, mib, seconds, scratch) if r["algorithm"] == "ring")
        times[row["nbytes"]] = row["time_s"]
        print(f"traffic np={np_} {row['nbytes']} bytes: ring {row['time_s'] * 1e3:.3f} ms",
              file=sys.stderr, flush=True)
    return times


def fit_link(times: dict[int, float], size: int) -> model.Link:
    """alpha and B from t = 2(P-1) alpha + 2(P-1)/P N/B, least squares on the relative
    error (each size counts alike, from 256 KiB to 16 MiB)."""
    rows = [(2 * (size - 1) / t, 2 * (size - 1) / size * n / t) for n, t in times.items()]
    saa, sab, sbb = (sum(a * a for a, _ in rows), sum(a * b for a, b in rows),
                     sum(b * b for _, b in rows))
    sa, sb = sum(a for a, _ in rows), sum(b for _, b in rows)     # the targets are all 1
    det = saa * sbb - sab * sab
    alpha, per_byte = (sa * sbb - sab * sb) / det, (saa * sb - sab * sa) / det
    if per_byte <= 0:
        raise RuntimeError(f"the ring's times {times} give no bandwidth: too noisy to fit")
    return model.Link("this machine", 1 / per_byte, max(0.0, alpha), "fitted at np=2")


def comm_table(link: model.Link, measured: dict[int, dict[int, float]]) -> list[dict[str, Any]]:
    rows = []
    for np_, times in measured.items():
        cost = model.allreduce_cost("ring", np_, link)
        for nbytes, seconds in times.items():
            forecast = cost.latency + cost.per_byte * nbytes
            rows.append({"np": np_, "nbytes": nbytes, "measured_s": seconds,
                         "forecast_s": forecast, "error": forecast / seconds - 1})
    return rows


def _measured(name: str, np_: int, seconds: float) -> tuple[float, dict[str, Any]]:
    """One launch with HVDLITE_REPORT: samples/s and the report."""
    with tempfile.TemporaryDirectory(prefix="hvdlite-forecast-") as directory:
        rate = launches.launch(_worker(name, seconds, directory), np_)["samples_per_s"]
        with open(os.path.join(directory, "report.json")) as handle:
            return rate, json.load(handle)


def _median(report: dict[str, Any], field: str) -> float:
    return statistics.median(r[field] or 0.0 for r in report["ranks"])


def _round(name: str, link: model.Link, seconds: float) -> dict[str, float]:
    """One rank with a report, the forecast for two from it, then two ranks measured."""
    rate1, report1 = _measured(name, 1, seconds)
    work = model.workload_from_report(report1, batch=training.BATCH[name])
    rate2, report2 = _measured(name, 2, seconds)
    # The same forecast given the compute two ranks really had: what is left is the
    # communication model's error (on a shared 2-core host, compute slows at np=2).
    given = dataclasses.replace(work, compute_s=_median(report2, "compute_time_s"))
    during = model.step(work, 2, "ring", link, True)
    return {"np1": rate1, "np2": rate2, "forecast": during["samples_per_s"],
            "forecast_after": model.step(work, 2, "ring", link, False)["samples_per_s"],
            "forecast_given_compute": model.step(given, 2, "ring", link, True)["samples_per_s"],
            "compute_ms_np1": work.compute_s * 1e3, "compute_ms_np2": given.compute_s * 1e3,
            "exposed_ms_forecast": during["exposed_s"] * 1e3,
            "exposed_ms_measured": _median(report2, "exposed_comm_s") * 1e3,
            "grad_mb": work.grad_bytes / 1e6, "buckets": float(work.buckets or 0),
            "step_sd_ms": work.step_sd_s * 1e3}


def one_model(name: str, link: model.Link, rounds: int, seconds: float) -> dict[str, Any]:
    """Rounds of (one rank, two ranks), paired in time; medians over the rounds."""
    results = []
    for round_ in range(rounds):
        results.append(_round(name, link, seconds))
        last = results[-1]
        print(f"{name} round {round_ + 1}/{rounds}: np=1 {last['np1']:.0f}, forecast np=2 "
              f"{last['forecast']:.0f}, measured np=2 {last['np2']:.0f} samples/s",
              file=sys.stderr, flush=True)
    summary: dict[str, Any] = {"model": name, "rounds": results}
    for key in results[0]:
        summary[key] = statistics.median(r[key] for r in results)
    summary["error"] = summary["forecast"] / summary["np2"] - 1
    summary["error_given_compute"] = summary["forecast_given_compute"] / summary["np2"] - 1
    return summary


def _worker(name: str, seconds: float, report: str) -> launches.Method:
    return launches.Method(name, ("training-worker", "--method", "hvdlite", "--model", name,
                                  "--seconds", str(seconds)), (("HVDLITE_REPORT", report),))


def render(link: model.Link, comm: list[dict[str, Any]], models: list[dict[str, Any]]) -> str:
    lines = [f"This machine's link, fitted to bench traffic's ring at np=2: "
             f"{link.bandwidth / 1e9:.3g} GB/s, {link.latency * 1e6:.3g} us per message",
             f"{'np':>3} {'bytes':>10} | {'measured ms':>11} {'forecast ms':>11} {'error':>7}"]
    lines += [f"{r['np']:>3} {r['nbytes']:>10} | {r['measured_s'] * 1e3:11.3f} "
              f"{r['forecast_s'] * 1e3:11.3f} {r['error']:+7.0%}" for r in comm]
    lines += ["", "Training (medians over rounds): one rank with HVDLITE_REPORT, the forecast "
              "for two ranks from its report, two ranks measured (also with HVDLITE_REPORT)"]
    for m in models:
        spread = {k: launches.Samples([r[k] for r in m["rounds"]]).spread()
                  for k in ("np1", "np2")}
        lines += [f"{m['model']}: {m['grad_mb']:.2f} MB in {m['buckets']:.0f} buckets per step, "
                  f"step deviation {m['step_sd_ms']:.2f} ms",
                  f"  samples/s: np=1 {m['np1']:.0f} ({spread['np1'].strip()}), forecast np=2 "
                  f"{m['forecast']:.0f} (after backward {m['forecast_after']:.0f}), measured "
                  f"np=2 {m['np2']:.0f} ({spread['np2'].strip()}): error {m['error']:+.0%}",
                  f"  compute ms/step: np=1 {m['compute_ms_np1']:.2f}, np=2 "
                  f"{m['compute_ms_np2']:.2f}; with np=2's compute the forecast is "
                  f"{m['forecast_given_compute']:.0f}: error {m['error_given_compute']:+.0%}",
                  f"  exposed communication ms/step at np=2: forecast "
                  f"{m['exposed_ms_forecast']:.2f}, measured {m['exposed_ms_measured']:.2f}"]
    return "\n".join(lines)


def main(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench forecast-check",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=training.MODELS, default=["mlp"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=2.0, help="timed loop per launch")
    parser.add_argument("--mib", type=float, nargs="+", default=[0.25, 1.0, 4.0, 16.0],
                        help="ring buffer sizes timed by bench traffic")
    parser.add_argument("--traffic-seconds", type=float, default=0.5)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="hvdlite-forecast-") as scratch:
        measured = {np_: ring_times(np_, args.mib, args.traffic_seconds, scratch)
                    for np_ in (2, 4)}
    link = fit_link(measured[2], 2)
    comm = comm_table(link, measured)
    models = [one_model(name, link, args.rounds, args.seconds) for name in args.models]
    # Neighbours' load skews every figure here: say how busy the machine was.
    machine = {"cores": os.cpu_count(), "load_before": load_before,
               "load_after": os.getloadavg()[0]}
    if args.json:
        print(json.dumps({"link": {"bandwidth": link.bandwidth, "latency": link.latency},
                          "comm": comm, "models": models, "machine": machine}))
    else:
        print(render(link, comm, models) + f"\n{machine['cores']} cores; 1-minute load "
              f"average {machine['load_before']:.1f} before, {machine['load_after']:.1f} after")
