"""The report's judgement, from every rank's record: stragglers, exposed
communication, memory imbalance and a one-line verdict. Pure functions on
plain dicts (no MPI), so the rules are unit-tested on made-up records.

Straggler rule. A straggler is the rank the others wait for. Its own tensors
are agreed almost as soon as it submits them (everyone else is already
waiting), so its peer wait is small while every other rank's is large. For
each rank s let gap(s) = median over the other ranks of their peer wait per
step, minus s's own. s is a straggler when

    gap(s) >= max(STRAGGLER_MIN_GAP_S, STRAGGLER_STEP_SHARE x median step time)

Only differences between ranks measured over the same steps count, so a
uniformly slow or noisy machine (shared cores, engine wake-up latency that
every rank has) names nobody; the threshold is relative to the step, so a
long step needs a proportionally larger gap. With two ranks at most one of
them can have a positive gap.
"""
from __future__ import annotations

import statistics
from typing import Any, Optional, Sequence

from hvdlite.diagnostics import scaling_model
from hvdlite.errors import ConfigError
from hvdlite.policy import tuning

STRAGGLER_MIN_GAP_S = 0.005     # below 5 ms per step, scheduling noise on a shared host
STRAGGLER_STEP_SHARE = 0.10     # ... and at least a tenth of the median step
COMM_SHARE_HIGH = 0.25          # exposed communication worth acting on
MEMORY_IMBALANCE_HIGH = 1.5     # max / min peak RSS across ranks
# The report's forecast line: a report cannot see the cluster's network, so it takes the
# commonest one without RDMA, which is also the setting the model was checked against.
FORECAST_NETWORK = "25GbE"
FORECAST_SIZES = (8, 64, 512)
FORECAST_WHY = "the commonest cluster network, and the one checked against the Horovod paper"

STRAGGLER_RULE = (
    f"rank s is a straggler when the median peer wait per step of the other ranks "
    f"exceeds its own by at least max({STRAGGLER_MIN_GAP_S * 1e3:.0f} ms, "
    f"{STRAGGLER_STEP_SHARE:.0%} of the median step time)")


def summarize(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The report.json document from every rank's record (api.report.local_record)."""
    ranks = [_derive(dict(r)) for r in sorted(records, key=lambda r: r["rank"])]
    # Every rank counts the same commits (they agree on each write): rank 0's stands.
    elastic = [r.pop("elastic", None) for r in ranks]
    settings = [r.pop("settings", None) for r in ranks]     # rank 0 decided them for all
    _attribute_waiting(ranks)
    measured = [r for r in ranks if r["steps"]]
    gaps = straggler_gaps(measured)
    threshold = straggler_threshold(measured)
    stragglers = [rank for rank, gap in gaps.items() if gap >= threshold]
    shares = [r["exposed_comm_s"] / r["step_time_s"] for r in measured if r["step_time_s"] > 0]
    comm_share = statistics.median(shares) if shares else None
    memory = _memory(ranks)
    summary = {
        "np": len(ranks), "ranks": ranks, "stragglers": stragglers,
        "straggler_gap_s": {str(rank): gaps[rank] for rank in stragglers},
        "straggler_rule": STRAGGLER_RULE, "comm_share": comm_share, "memory": memory,
        "elastic": elastic[0] if elastic else None,
        "settings": settings[0] if settings else None,
    }
    summary["verdict"] = verdict(summary, gaps)
    summary["forecast"] = forecast(summary)
    return summary


def forecast(summary: dict[str, Any]) -> dict[str, Any]:
    """Expected efficiency at FORECAST_SIZES ranks: ring, overlapping backward, on
    FORECAST_NETWORK (hvdlite/diagnostics/scaling_model.py); ``note`` says why not, if not."""
    try:
        work = scaling_model.workload_from_report(summary)
    except ConfigError as exc:
        return {"note": str(exc)}
    link = scaling_model.NETWORKS[FORECAST_NETWORK]
    return {"network": link.name, "algorithm": "ring", "overlap": True,
            "efficiency": {str(p): scaling_model.step(work, p, "ring", link, True)["efficiency"]
                           for p in FORECAST_SIZES}}


def _derive(record: dict[str, Any]) -> dict[str, Any]:
    """Per-step figures a rank's window gives; None for every one without steps."""
    record.setdefault("steps", 0)
    if not record["steps"]:
        for field in ("step_time_s", "compute_time_s", "comm_wait_s", "peer_wait_s",
                      "waiting_for_peers_s", "exposed_comm_s", "other_wait_s",
                      "bytes_sent", "bytes_received", "step_time_sd_s", "allreduce_calls",
                      "allreduce_tensors", "allreduce_bytes"):
            record[field] = None
        return record
    record["comm_wait_s"] = record.pop("optimizer_wait_s") + record["other_wait_s"]
    record["compute_time_s"] = max(0.0, record["step_time_s"] - record["comm_wait_s"])
    return record


def _attribute_waiting(ranks: list[dict[str, Any]]) -> None:
    """Split each rank's blocked time into waiting for peers and exposed
    communication. Every rank's peer wait holds a floor that is not imbalance
    (its own queueing, negotiation latency); the least waiting rank shows it."""
    measured = [r for r in ranks if r["steps"]]
    floor = min((r["peer_wait_s"] for r in measured), default=0.0)
    for r in measured:
        waiting = min(r["comm_wait_s"], max(0.0, r["peer_wait_s"] - floor))
        r["waiting_for_peers_s"] = waiting
        r["exposed_comm_s"] = r["comm_wait_s"] - waiting


def straggler_gaps(ranks: Sequence[dict[str, Any]]) -> dict[int, float]:
    """rank -> median peer wait of the others minus its own (seconds per step)."""
    if len(ranks) < 2:
        return {}
    gaps = {}
    for r in ranks:
        others = [o["peer_wait_s"] for o in ranks if o is not r]
        gaps[r["rank"]] = statistics.median(others) - r["peer_wait_s"]
    return gaps


def straggler_threshold(ranks: Sequence[dict[str, Any]]) -> float:
    steps = [r["step_time_s"] for r in ranks]
    median_step = statistics.median(steps) if steps else 0.0
    return max(STRAGGLER_MIN_GAP_S, STRAGGLER_STEP_SHARE * median_step)


def _memory(ranks: Sequence[dict[str, Any]]) -> dict[str, Any]:
    rss = {r["rank"]: r["rss_peak_bytes"] for r in ranks}
    low, high = min(rss, key=rss.get), max(rss, key=rss.get)
    return {"rss_min_bytes": rss[low], "rss_min_rank": low, "rss_max_bytes": rss[high],
            "rss_max_rank": high,
            "imbalance": rss[high] / rss[low] if rss[low] else None}


def verdict(summary: dict[str, Any], gaps: dict[int, float]) -> str:
    """One line: the first of stragglers, communication, memory, or balance."""
    measured = [r for r in summary["ranks"] if r["steps"]]
    if len(measured) < len(summary["ranks"]) or not measured:
        return ("no optimizer steps were recorded on every rank (at least two steps of "
                "a DistributedOptimizer are needed): nothing to judge")
    if summary["stragglers"]:
        parts = [f"rank {s} is {gaps[s] * 1e3:.0f} ms slower per step than the median"
                 for s in summary["stragglers"]]
        return "; ".join(parts) + ": its data loading or its host is slow"
    share = summary["comm_share"]
    if share is not None and share >= COMM_SHARE_HIGH:
        return (f"communication costs {share:.0%} of each step: raise the batch per rank "
                "or the fusion threshold")
    memory = summary["memory"]
    if memory["imbalance"] is not None and memory["imbalance"] >= MEMORY_IMBALANCE_HIGH:
        return (f"well balanced in time, but rank {memory['rss_max_rank']} peaks at "
                f"{memory['imbalance']:.1f}x the memory of rank {memory['rss_min_rank']}")
    return (f"well balanced: no straggler, communication exposes "
            f"{(share or 0.0):.0%} of each step")


def _ms(value: Optional[float]) -> str:
    return "-" if value is None else f"{value * 1e3:.1f}"


def _mib(value: Optional[float]) -> str:
    return "-" if value is None else f"{value / (1 << 20):.2f}"


_COLUMNS = ("rank", "host", "steps", "step", "compute", "comm wait", "waiting",
            "exposed comm", "peer wait", "sent MiB", "recv MiB", "peak RSS MiB", "GPU MiB",
            "GPU util")
_LEGEND = ("step = compute + comm wait (blocked in synchronize); comm wait = waiting for "
           "slower peers + exposed comm;\npeer wait = time this rank's tensors waited for "
           "agreement (overlaps compute); sent/recv per step, peak RSS and GPU over the run")


def render_text(summary: dict[str, Any]) -> str:
    """report.txt: a table per rank (times per step), then the findings."""
    rows = [[str(r["rank"]), r["host"], str(r["steps"]), _ms(r["step_time_s"]),
             _ms(r["compute_time_s"]), _ms(r["comm_wait_s"]), _ms(r["waiting_for_peers_s"]),
             _ms(r["exposed_comm_s"]), _ms(r["peer_wait_s"]), _mib(r["bytes_sent"]),
             _mib(r["bytes_received"]), _mib(r["rss_peak_bytes"]), _mib(r["gpu_mem_peak_bytes"]),
             "-" if r["gpu_util"] is None else f"{r['gpu_util']:.0%}"]
            for r in summary["ranks"]]
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(_COLUMNS)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths)).rstrip()
    out = [f"hvdlite report: {summary['np']} ranks; times are ms per optimizer step, "
           "bytes per step", "", line(_COLUMNS), *(line(row) for row in rows), "", _LEGEND, ""]
    out += _findings(summary)
    return "\n".join(out) + "\n"


def _findings(summary: dict[str, Any]) -> list[str]:
    ranks = summary["ranks"]
    lines = []
    if summary["stragglers"]:
        named = ", ".join(f"rank {s} (the others wait {summary['straggler_gap_s'][str(s)] * 1e3:.1f}"
                          " ms per step for it)" for s in summary["stragglers"])
        lines.append(f"stragglers: {named}")
    else:
        lines.append("stragglers: none")
    lines.append(f"  rule: {summary['straggler_rule']}")
    share = summary["comm_share"]
    lines.append("exposed communication: " + ("not measured" if share is None else
                 f"{share:.0%} of each step (median over ranks)"))
    memory = summary["memory"]
    if memory["imbalance"] is not None:
        lines.append(f"peak memory (RSS): {_mib(memory['rss_min_bytes'])} MiB on rank "
                     f"{memory['rss_min_rank']} to {_mib(memory['rss_max_bytes'])} MiB on rank "
                     f"{memory['rss_max_rank']} ({memory['imbalance']:.2f}x)")
    notes = sorted({r["gpu_note"] for r in ranks if r.get("gpu_note")})
    if notes:
        lines.append("GPU: " + "; ".join(notes))
    if any(r.get("bytes_estimated") for r in ranks):
        lines.append("bytes: partly estimated (the transport library's own collectives, "
                     "MPI's or Gloo's, whose algorithm the library chooses, count what a "
                     "bandwidth-optimal algorithm moves)")
    if summary.get("elastic"):
        lines.append(elastic_line(summary["elastic"]))
    lines += tuning.report_lines(summary.get("settings"))
    lines.append(_forecast_line(summary.get("forecast") or {}))
    lines.append(f"verdict: {summary['verdict']}")
    return lines


def elastic_line(counts: dict[str, Any]) -> str:
    """One line: 'elastic: 2 of 5 commits reached the disk (...); ... holds commit 4'."""
    every = counts["persist_every"]
    interval = (f" (every {_ordinal(every)}: HVDLITE_ELASTIC_PERSIST_EVERY={every})"
                if every > 1 else "")
    failed = f", {counts['failed']} failed to" if counts["failed"] else ""
    held = "no commit" if counts["on_disk"] is None else f"commit {counts['on_disk']}"
    return (f"elastic: {counts['written']} of {counts['commits']} commits reached the "
            f"disk{interval}{failed}; HVDLITE_ELASTIC_DIR={counts['directory']} holds {held}")


def _ordinal(number: int) -> str:
    teens = 10 <= number % 100 <= 20
    suffix = "th" if teens else {1: "st", 2: "nd", 3: "rd"}.get(number % 10, "th")
    return f"{number}{suffix}"


def _forecast_line(made: dict[str, Any]) -> str:
    if "efficiency" not in made:
        return f"scaling forecast: none ({made.get('note', 'no forecast in this report')})"
    cells = ", ".join(f"{share:.0%} at {p}" for p, share in made["efficiency"].items())
    return (f"scaling forecast (ring overlapping backward, on {made['network']}: "
            f"{FORECAST_WHY}): {cells} ranks; other networks: python -m "
            "hvdlite.forecast --report DIR")
