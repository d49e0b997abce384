"""report.png: per rank, where a step's time goes (stacked: compute, waiting for
peers, exposed communication, in ms per step) and peak memory beside it.
Needs matplotlib (the 'report' extra); drawn off-screen with the Agg backend."""
from __future__ import annotations

from typing import Any

import matplotlib
matplotlib.use("Agg")                   # no display on a cluster node
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

_PARTS = (("compute_time_s", "compute (and data loading)", "#4c72b0"),
          ("waiting_for_peers_s", "waiting for peers", "#dd8452"),
          ("exposed_comm_s", "exposed communication", "#c44e52"))


def draw(summary: dict[str, Any], path: str) -> None:
    ranks = summary["ranks"]
    labels = [f"rank {r['rank']}" + (" *" if r["rank"] in summary["stragglers"] else "")
              for r in ranks]
    x = list(range(len(ranks)))
    figure, (time_ax, memory_ax) = plt.subplots(
        1, 2, figsize=(max(9.0, 1.2 * len(ranks) + 6), 4.8),
        gridspec_kw={"width_ratios": [3, 2]})
    bottom = [0.0] * len(ranks)
    for field, name, color in _PARTS:
        heights = [(r[field] or 0.0) * 1e3 for r in ranks]
        time_ax.bar(x, heights, bottom=bottom, label=name, color=color)
        bottom = [b + h for b, h in zip(bottom, heights)]
    time_ax.set_xticks(x, labels)
    time_ax.set_ylabel("ms per optimizer step")
    time_ax.set_title("Where each step's time goes (* = straggler)")
    time_ax.legend(loc="upper right", fontsize="small")
    time_ax.set_ylim(0, max(bottom + [1.0]) * 1.25)
    _memory(memory_ax, ranks, x, labels)
    figure.suptitle("hvdlite report: " + _wrap(summary["verdict"]), fontsize="medium")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _memory(ax: Any, ranks: list[dict[str, Any]], x: list[int], labels: list[str]) -> None:
    gpu = [r["gpu_mem_peak_bytes"] for r in ranks]
    has_gpu = any(v is not None for v in gpu)
    width = 0.4 if has_gpu else 0.6
    rss = [r["rss_peak_bytes"] / (1 << 20) for r in ranks]
    ax.bar([i - (width / 2 if has_gpu else 0) for i in x], rss, width, label="host RSS",
           color="#55a868")
    if has_gpu:
        ax.bar([i + width / 2 for i in x], [(v or 0) / (1 << 20) for v in gpu], width,
               label="GPU memory", color="#8172b2")
    ax.set_xticks(x, labels)
    ax.set_ylabel("MiB")
    ax.set_title("Peak memory per rank")
    if not has_gpu:
        ax.set_xlabel("GPU memory not measured")
    ax.legend(loc="upper right", fontsize="small")
    ax.set_ylim(0, max(rss + [1.0]) * 1.25 if not has_gpu else None)


def _wrap(text: str, width: int = 100) -> str:
    if len(text) <= width:
        return text
    cut = text.rfind(" ", 0, width)
    return text[:cut] + "\n" + text[cut + 1:]
