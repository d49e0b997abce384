"""Will it scale? Step time, samples/s and scaling efficiency on P = 1 to 1024 ranks,
forecast from one measured run (its HVDLITE_REPORT report.json) or from numbers you give.

    python -m hvdlite.forecast --report DIR/report.json [--batch-size 64]
    python -m hvdlite.forecast --compute-ms 450 --params 23.8e6 --tensors 190
    python -m hvdlite.forecast --paper       # the check against the Horovod paper

One process, no MPI. For each network (--network, or --bandwidth and --latency) and
algorithm (ring, parameter server, hierarchical when --ranks-per-node > 1) it prints
the forecast with communication after backward and overlapping it, and draws the
efficiency against P (--plot). The model is hvdlite/diagnostics/scaling_model.py's.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Optional, Sequence

from hvdlite.config import parse_bytes
from hvdlite.diagnostics import scaling_model as model
from hvdlite.errors import ConfigError

DEFAULT_NETWORKS = ("25GbE", "100GbE", "IB-HDR")
DEFAULT_PLOT = "forecast.png"
MAX_P = 1024


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hvdlite.forecast",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--report", help="report.json (or its directory) from HVDLITE_REPORT")
    p.add_argument("--compute-ms", type=float, help="one rank's step without communication")
    p.add_argument("--grad-bytes", help="bytes reduced per step (suffixes: 91MiB)")
    p.add_argument("--params", type=float, help="... or parameters, 4 bytes of gradient each")
    p.add_argument("--tensors", type=int, help="gradient tensors per step (buckets at most)")
    p.add_argument("--buckets", type=int, help="reductions per step while backward runs")
    p.add_argument("--fusion-bytes", default="64MiB", help="HVDLITE_FUSION_THRESHOLD")
    p.add_argument("--backward-share", type=float, help="backward's share of compute (2/3)")
    p.add_argument("--overlap", type=float, help="share of backward that can hide "
                   "communication (1.0)")
    p.add_argument("--step-sd-ms", type=float, help="step-to-step deviation of compute")
    p.add_argument("--batch-size", type=float, help="samples per rank per step (samples/s)")
    p.add_argument("--network", action="append", help=f"one of {', '.join(model.NETWORKS)} "
                   f"(repeat it; default {', '.join(DEFAULT_NETWORKS)})")
    p.add_argument("--bandwidth", type=float, help="your link instead: GB/s a ring reaches")
    p.add_argument("--latency", type=float, help="... and us per message")
    p.add_argument("--ranks-per-node", type=int, default=1, help="ranks sharing a node")
    p.add_argument("--intra", default="NVLink", help="the link inside a node (NVLink, PCIe)")
    p.add_argument("--algorithms", nargs="+", default=list(model.ALGORITHMS))
    p.add_argument("--sizes", type=int, nargs="+", default=[], help="more P to forecast")
    p.add_argument("--max-p", type=int, default=MAX_P, help="largest power of two P")
    p.add_argument("--json", action="store_true", help="print the rows as JSON only")
    p.add_argument("--plot", default=DEFAULT_PLOT, help="where to draw: a file, or a "
                   f"directory to draw {DEFAULT_PLOT} in ('' for no plot)")
    p.add_argument("--paper", action="store_true", help="the Horovod paper check, then exit")
    return p


def load_report(path: str) -> dict[str, Any]:
    """report.json at ``path`` (or in the directory ``path``)."""
    if os.path.isdir(path):
        path = os.path.join(path, "report.json")
    try:
        with open(path, "rb") as handle:
            return json.loads(handle.read().decode("utf-8"))
    except OSError as exc:
        raise ConfigError(f"--report {path}: cannot read it ({exc.strerror}); give the "
                          "report.json an HVDLITE_REPORT run wrote, or its directory") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"--report {path} is not text (UTF-8): byte {exc.start} is "
                          f"{exc.object[exc.start]:#04x}; give the report.json an "
                          "HVDLITE_REPORT run wrote") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--report {path} is not JSON ({exc.msg} at line {exc.lineno}); "
                          "give the report.json an HVDLITE_REPORT run wrote") from None


def _grad_bytes(args: argparse.Namespace) -> Optional[float]:
    if args.grad_bytes is not None and args.params is not None:
        raise ConfigError("give --grad-bytes or --params, not both")
    if args.params is not None:
        return 4.0 * args.params
    if args.grad_bytes is None:
        return None
    try:
        return float(parse_bytes(args.grad_bytes))
    except ValueError as exc:
        raise ConfigError(f"--grad-bytes {args.grad_bytes!r}: {exc}; write bytes, or a size "
                          "like 91MiB") from None


def workload(args: argparse.Namespace) -> model.Workload:
    """The Workload the arguments describe (a report's, with flags replacing fields)."""
    try:
        fusion = float(parse_bytes(args.fusion_bytes))
    except ValueError as exc:
        raise ConfigError(f"--fusion-bytes {args.fusion_bytes!r}: {exc}") from None
    ms = lambda value: None if value is None else value / 1e3     # noqa: E731
    given = {"compute_s": ms(args.compute_ms), "grad_bytes": _grad_bytes(args),
             "buckets": args.buckets if args.buckets is not None else args.tensors,
             "step_sd_s": ms(args.step_sd_ms), "backward_share": args.backward_share,
             "overlap": args.overlap, "batch": args.batch_size, "fusion_bytes": fusion}
    if args.report is not None:
        return model.workload_from_report(load_report(args.report), args.report, **given)
    missing = [flag for flag, key in (("--compute-ms", "compute_s"),
                                      ("--grad-bytes or --params", "grad_bytes"))
               if given[key] is None]
    if missing:
        raise ConfigError(f"the forecast needs {' and '.join(missing)} (or --report with "
                          "an HVDLITE_REPORT report.json)")
    return model.Workload(**{k: v for k, v in given.items() if v is not None}).check()


def links(args: argparse.Namespace) -> list[model.Link]:
    if (args.bandwidth is None) != (args.latency is None):
        raise ConfigError("--bandwidth and --latency go together: give both (GB/s and us "
                          "per message), or name a --network")
    chosen = [model.network(name) for name in args.network or ()]
    if args.bandwidth is not None:
        chosen.append(model.custom_link(args.bandwidth, args.latency))
    return chosen or [model.NETWORKS[name] for name in DEFAULT_NETWORKS]


def intra_link(args: argparse.Namespace) -> Optional[model.Link]:
    """The link inside a node, or None with one rank per node. A name the forecast does
    not know is refused even then: a misspelt --intra would otherwise pass unnoticed."""
    link = model.network(args.intra, flag="--intra")
    return link if args.ranks_per_node > 1 else None


def plot_path(args: argparse.Namespace) -> str:
    """Where --plot draws ('' for nowhere): the file given, or forecast.png inside a
    directory given. Checked before anything is printed (created, written and removed,
    as HVDLITE_TIMELINE is at init), so a path that cannot be written is an error,
    not a table followed by a traceback."""
    from hvdlite.recording.outputs import file_problem
    path = args.plot
    if not path:
        return ""
    if os.path.isdir(path):
        path = os.path.join(path, DEFAULT_PLOT)
    unknown = _format_problem(path)
    if unknown is not None:
        raise ConfigError(f"--plot {args.plot!r} cannot be used: {unknown}; name a file with "
                          "one of those extensions, or none (PNG)")
    problem = file_problem(path)
    if problem is not None:
        raise ConfigError(f"--plot {args.plot!r} cannot be used: {problem}; give a file in "
                          "an existing directory you can write (or a directory), or --plot "
                          "'' for no plot")
    return path


def _format_problem(path: str) -> Optional[str]:
    """Why matplotlib would refuse ``path``'s extension (None without matplotlib: the
    plot is then skipped with a note). A path without one is drawn as PNG, as named."""
    extension = os.path.splitext(path)[1][1:].lower()
    if not extension:
        return None
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
    except ImportError:
        return None
    known = FigureCanvasAgg.get_supported_filetypes()
    if extension in known:
        return None
    return f"matplotlib draws no '.{extension}' files (it draws {', '.join(sorted(known))})"


def sizes(args: argparse.Namespace) -> list[int]:
    for size in [args.max_p, *args.sizes]:
        if size < 1:
            raise ConfigError(f"P = {size}: a forecast needs at least 1 rank (--sizes and "
                              "--max-p take whole numbers of ranks from 1)")
    powers = [1 << k for k in range(args.max_p.bit_length()) if 1 << k <= args.max_p]
    return sorted(set(powers) | set(args.sizes))


def algorithms(args: argparse.Namespace) -> list[str]:
    for name in args.algorithms:
        if name not in model.ALGORITHMS:
            raise ConfigError(f"--algorithms {name!r}: use some of "
                              f"{', '.join(model.ALGORITHMS)}")
    if args.ranks_per_node < 1:
        raise ConfigError(f"--ranks-per-node must be at least 1, got {args.ranks_per_node}")
    if args.ranks_per_node == 1:      # one rank per node: hierarchical is the ring
        return [name for name in args.algorithms if name != "hierarchical"]
    return list(args.algorithms)


def forecast(work: model.Workload, networks: Sequence[model.Link], names: Sequence[str],
             ranks: Sequence[int], intra: Optional[model.Link] = None,
             per_node: int = 1) -> list[dict[str, Any]]:
    """Every row: each network, algorithm, with and without overlap, and P."""
    return [model.step(work, size, name, link, overlap, intra, per_node)
            for link in networks for name in names for overlap in (False, True)
            for size in ranks if link.max_ranks is None or size <= link.max_ranks]


def render(work: model.Workload, rows: Sequence[dict[str, Any]],
           networks: Sequence[model.Link], per_node: int) -> str:
    out = [_describe(work, per_node)]
    for link in networks:
        mine = [r for r in rows if r["network"] == link.name]
        out += ["", link.describe() + (f"; at most {link.max_ranks} ranks" if link.max_ranks
                                       else ""),
                f"{'P':>5} | {'algorithm':<12} | {'step ms: after / overlapping':>28} | "
                f"{'efficiency':>16} | {'samples/s':>10} | buckets"]
        after = {(r["algorithm"], r["ranks"]): r for r in mine if not r["overlap"]}
        for row in (r for r in mine if r["overlap"]):
            first = after[(row["algorithm"], row["ranks"])]
            rate = "-" if row["samples_per_s"] is None else f"{row['samples_per_s']:.0f}"
            out.append(f"{row['ranks']:>5} | {row['algorithm']:<12} | "
                       f"{first['step_s'] * 1e3:13.2f} / {row['step_s'] * 1e3:<12.2f} | "
                       f"{first['efficiency']:6.1%} / {row['efficiency']:6.1%} | "
                       f"{rate:>10} | {row['buckets']}")
    return "\n".join(out)


def _describe(work: model.Workload, per_node: int) -> str:
    lines = [f"Workload per rank: compute {work.compute_s * 1e3:.4g} ms/step, "
             f"{work.grad_bytes / 1e6:.4g} MB reduced/step in {work.buckets or 'fused'} "
             f"buckets (fusion {work.fusion_bytes / (1 << 20):g} MiB), backward "
             f"{work.backward_share:.0%} of compute, overlap {work.overlap:.0%} of it, "
             f"step deviation {work.step_sd_s * 1e3:.3g} ms, {per_node} rank(s) per node",
             "efficiency = one rank's step / P ranks' step; 'after': communication starts "
             "when backward ends; 'overlapping': it runs during backward"]
    if work.batch is None:
        lines.append("samples/s: give --batch-size (samples per rank per step)")
    if per_node == 1:
        lines.append("hierarchical: needs --ranks-per-node > 1 (one rank per node makes it "
                     "the ring)")
    return "\n".join(lines)


def plot(rows: Sequence[dict[str, Any]], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
    styles = {"ring": "-", "ps": ":", "hierarchical": "--"}
    networks = list(dict.fromkeys(r["network"] for r in rows))
    for ax, overlap in zip(axes, (False, True)):
        for index, network in enumerate(networks):
            for name, style in styles.items():
                line = [r for r in rows if r["network"] == network and r["algorithm"] == name
                        and r["overlap"] is overlap]
                if line:
                    ax.plot([r["ranks"] for r in line], [100 * r["efficiency"] for r in line],
                            style, color=f"C{index}", marker="o", markersize=3,
                            label=f"{name}, {network}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("ranks P")
        ax.set_title("overlapping backward" if overlap else "after backward")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("scaling efficiency (%)")
    axes[1].legend(fontsize="x-small")
    figure.suptitle("hvdlite scaling forecast")
    figure.tight_layout()
    # Without an extension matplotlib would add '.png' to the name: draw the file named.
    figure.savefig(path, dpi=110, format=None if os.path.splitext(path)[1] else "png")
    plt.close(figure)


def run(args: argparse.Namespace) -> None:
    if args.paper:
        from hvdlite import forecast_paper
        print(forecast_paper.report())
        return
    work = workload(args)
    networks, names, ranks = links(args), algorithms(args), sizes(args)
    intra, drawing = intra_link(args), plot_path(args)
    rows = forecast(work, networks, names, ranks, intra, args.ranks_per_node)
    print(json.dumps(rows) if args.json else render(work, rows, networks,
                                                    args.ranks_per_node), flush=True)
    if not drawing:
        return
    try:
        plot(rows, drawing)
    except ImportError:
        if not args.json:
            print("\nno plot: matplotlib is not installed (pip install 'hvdlite[report]')")
        return
    except OSError as exc:      # checked above; a disk that filled since, say
        raise ConfigError(f"--plot {drawing!r}: drawing it failed ({exc.strerror or exc})") \
            from None
    if not args.json:
        print(f"\nplot: {drawing}")


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parser().parse_args(argv)
    try:
        run(args)
    except ConfigError as exc:
        print(f"python -m hvdlite.forecast: error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
