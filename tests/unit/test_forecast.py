"""The scaling forecast: its formulas against hand-computed values, reading a
report, the report's forecast line, and the CLI's answers to bad inputs (no MPI).
The check against the Horovod paper is tests/unit/test_forecast_paper.py."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from hvdlite.diagnostics import report_summary
from hvdlite.diagnostics import scaling_model as model
from bench import traffic
from hvdlite import forecast
from hvdlite.errors import ConfigError

NET = model.Link("net", 1e9, 10e-6)        # 1 GB/s, 10 us per message
NEAR = model.Link("near", 10e9, 1e-6)      # inside a node: 10 GB/s, 1 us


@pytest.mark.parametrize("size,ring,ps", [(2, 1000, 1000), (4, 1500, 3000), (8, 1750, 7000)])
def test_bytes_per_rank_are_the_textbook_formulas(size: int, ring: int, ps: int) -> None:
    assert model.formula_bytes("ring", 1000, size) == ring      # 2N(P-1)/P
    assert model.formula_bytes("ps", 1000, size) == ps          # N(P-1) at the server


def test_ring_and_server_costs_by_hand() -> None:
    ring = model.allreduce_cost("ring", 4, NET)
    assert ring.latency == pytest.approx(6 * 10e-6)             # 2(P-1) messages
    assert ring.per_byte == pytest.approx(6 / (4 * 1e9))        # 2(P-1)/(P B)
    server = model.allreduce_cost("ps", 4, NET)
    assert server.latency == pytest.approx(6 * 10e-6)
    assert server.per_byte == pytest.approx(6 / 1e9)            # 2(P-1)/B
    assert model.allreduce_cost("ring", 1, NET) == model.Cost(0.0, 0.0)


def test_a_ring_inside_one_node_uses_the_node_link_and_beyond_it_the_network() -> None:
    inside = model.allreduce_cost("ring", 4, NET, NEAR, per_node=4)
    assert inside.latency == pytest.approx(6e-6) and inside.per_byte == pytest.approx(6 / 40e9)
    across = model.allreduce_cost("ring", 8, NET, NEAR, per_node=4)
    assert across.latency == pytest.approx(14 * 10e-6)
    assert across.per_byte == pytest.approx(14 / (8 * 1e9))


def test_hierarchical_cost_by_hand() -> None:
    # 8 ranks, 4 per node: 2(L-1) steps inside, 2(M-1) across M = 2 nodes.
    cost = model.allreduce_cost("hierarchical", 8, NET, NEAR, per_node=4)
    assert cost.latency == pytest.approx(2 * 3 * 1e-6 + 2 * 1 * 10e-6)
    assert cost.per_byte == pytest.approx(2 * 3 / (4 * 10e9) + 2 * 1 / (2 * 1e9))
    ring = model.allreduce_cost("ring", 8, NET, NEAR, per_node=4)
    assert cost.latency < ring.latency                # what hierarchical buys: fewer hops


def test_traffic_bench_model_is_the_same_formula() -> None:
    assert traffic.model_seconds("ps", 1000, 4, 1e9, 10e-6) == pytest.approx(6 * (10e-6 + 1e-6))
    assert traffic.model_seconds("ring", 1000, 4, 1e9, 10e-6) == pytest.approx(
        6 * (10e-6 + 1000 / 4e9))


WORK = model.Workload(compute_s=0.3, grad_bytes=1e8, buckets=10, step_sd_s=0.0, batch=32)


def test_one_step_by_hand_with_and_without_overlap() -> None:
    # Per bucket: ring 6 x 10 us + negotiation 2 ceil(log2 4) x 10 us = 100 us.
    after = model.step(WORK, 4, "ring", NET, overlap=False)
    assert after["buckets"] == 2                         # all ready at once: ceil(1e8 / 64 MiB)
    assert after["comm_s"] == pytest.approx(2 * 100e-6 + 1.5e-9 * 1e8)
    assert after["step_s"] == pytest.approx(0.3 + after["comm_s"])
    during = model.step(WORK, 4, "ring", NET, overlap=True)
    assert during["buckets"] == 10
    assert during["comm_s"] == pytest.approx(10 * 100e-6 + 0.15)
    # Backward (0.2 s) hides all but the last bucket.
    assert during["exposed_s"] == pytest.approx(during["comm_s"] / 10)
    assert during["efficiency"] == pytest.approx(0.3 / (0.3 + during["comm_s"] / 10))
    assert during["samples_per_s"] == pytest.approx(4 * 32 / during["step_s"])


def test_overlap_is_bounded_by_backward() -> None:
    heavy = model.Workload(compute_s=0.3, grad_bytes=1e9, buckets=4)
    row = model.step(heavy, 4, "ring", NET, overlap=True)   # 1.5 s of bytes, 0.2 s backward
    assert row["exposed_s"] == pytest.approx(row["comm_s"] - 0.2)
    half = model.step(model.Workload(compute_s=0.3, grad_bytes=1e9, buckets=4, overlap=0.5),
                      4, "ring", NET, overlap=True)
    assert half["exposed_s"] == pytest.approx(half["comm_s"] - 0.1)


def test_fusion_makes_the_bucket_count_matter() -> None:
    many = model.step(model.Workload(compute_s=0.3, grad_bytes=1e6, buckets=1000), 64, "ring",
                      NET, overlap=True)
    few = model.step(model.Workload(compute_s=0.3, grad_bytes=1e6, buckets=10), 64, "ring",
                     NET, overlap=True)
    assert many["comm_s"] > 10 * few["comm_s"]              # latency per bucket dominates
    # Buckets go no faster than one per bucket latency (2 x 63 + 12 messages of 10 us).
    assert many["buckets"] == math.ceil(0.2 / (138 * 10e-6))


def test_one_rank_is_the_measured_step() -> None:
    row = model.step(model.Workload(compute_s=0.3, grad_bytes=1e8, step_sd_s=0.05), 1, "ps",
                     NET, overlap=False)
    assert row["step_s"] == 0.3 and row["efficiency"] == 1.0 and row["sync_s"] == 0.0


@pytest.mark.parametrize("size,exact", [(2, 1 / math.sqrt(math.pi)), (10, 1.5388),
                                        (100, 2.5076)])
def test_the_slowest_of_p_ranks(size: int, exact: float) -> None:
    """Blom's approximation against the exact expected maximum of P normals."""
    assert model.sync_z(1) == 0.0
    assert model.sync_z(size) == pytest.approx(exact, abs=0.03)
    row = model.step(model.Workload(compute_s=0.1, grad_bytes=0.0, step_sd_s=0.01), size,
                     "ring", NET, overlap=True)
    assert row["sync_s"] == pytest.approx(0.01 * model.sync_z(size))


@pytest.mark.parametrize("field,value,flag", [
    ("compute_s", 0.0, "--compute-ms"), ("grad_bytes", -1.0, "--grad-bytes or --params"),
    ("buckets", 0, "--buckets or --tensors"), ("overlap", 1.5, "--overlap"),
    ("backward_share", 0.0, "--backward-share"), ("step_sd_s", -0.1, "--step-sd-ms"),
    ("batch", 0, "--batch-size")])
def test_a_bad_workload_names_the_field_and_its_flag(field: str, value: float,
                                                     flag: str) -> None:
    fields = {"compute_s": 0.1, "grad_bytes": 1e6, field: value}
    with pytest.raises(ConfigError, match="the workload's") as caught:
        model.Workload(**fields).check()
    assert f"got {value!r} (give {flag})" in str(caught.value)


def test_no_ranks_below_one() -> None:
    with pytest.raises(ConfigError, match="at least 1 rank, got P = 0"):
        model.step(WORK, 0, "ring", NET, overlap=True)


def test_unknown_network_lists_the_known_ones() -> None:
    assert model.network("ib-hdr") is model.NETWORKS["IB-HDR"]
    with pytest.raises(ConfigError, match="'Myrinet'.*25GbE, 25GbE-RoCE.*--bandwidth"):
        model.network("Myrinet")


# -- from a report -------------------------------------------------------------------------
def rank(number: int, compute: float = 0.2, **fields: Any) -> dict[str, Any]:
    record = {"rank": number, "steps": 10, "compute_time_s": compute,
              "allreduce_bytes": 4e6, "allreduce_calls": 3.0, "allreduce_tensors": 6.0,
              "step_time_sd_s": 0.004}
    record.update(fields)
    return record


def test_a_report_gives_the_median_rank() -> None:
    report = {"ranks": [rank(0, 0.1), rank(1, 0.3), rank(2, 0.2)]}
    work = model.workload_from_report(report)
    assert (work.compute_s, work.grad_bytes, work.buckets, work.step_sd_s) == (0.2, 4e6, 3, 0.004)
    given = model.workload_from_report(report, compute_s=0.5, batch=8)
    assert given.compute_s == 0.5 and given.batch == 8 and given.grad_bytes == 4e6


@pytest.mark.parametrize("report,message", [
    ({"np": 2}, "no 'ranks' list"),
    ([1, 2], "no 'ranks' list"),
    ({"ranks": [{"rank": 0, "steps": 0}]}, "recorded no optimizer steps"),
    ({"ranks": [rank(0), rank(1, allreduce_bytes=None)]},
     r"no 'allreduce_bytes' \(bytes reduced per step\).*--grad-bytes"),
    ({"ranks": [{"rank": 0, "steps": 5, "compute_time_s": 0.1}]},
     r"no 'allreduce_bytes'.*older than the forecast"),
])
def test_a_report_without_what_the_forecast_needs(report: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        model.workload_from_report(report)


def test_a_flag_stands_in_for_a_missing_field() -> None:
    old = {"ranks": [{"rank": 0, "steps": 5, "compute_time_s": 0.1, "allreduce_calls": 2}]}
    assert model.workload_from_report(old, grad_bytes=1e6).grad_bytes == 1e6


def test_the_report_gains_one_forecast_line() -> None:
    records = [dict(rank(r), host="h", step_time_s=0.21, optimizer_wait_s=0.01,
                    other_wait_s=0.0, peer_wait_s=0.001, bytes_sent=1.0, bytes_received=1.0,
                    rss_peak_bytes=1 << 20, gpu_mem_peak_bytes=None, gpu_util=None)
               for r in range(2)]
    summary = report_summary.summarize(records)
    made = summary["forecast"]
    assert made["network"] == "25GbE" and list(made["efficiency"]) == ["8", "64", "512"]
    work = model.workload_from_report(summary)
    expected = model.step(work, 64, "ring", model.NETWORKS["25GbE"], True)["efficiency"]
    assert made["efficiency"]["64"] == pytest.approx(expected)
    lines = [l for l in report_summary.render_text(summary).splitlines() if "forecast" in l]
    assert len(lines) == 1 and lines[0].startswith(
        "scaling forecast (ring overlapping backward, on 25GbE: the commonest")
    assert f"{expected:.0%} at 64, " in lines[0] and " at 512 ranks;" in lines[0]


def test_a_report_without_the_fields_says_so_in_its_line() -> None:
    records = [{"rank": 0, "host": "h", "steps": 0, "rss_peak_bytes": 1, "gpu_mem_peak_bytes":
                None, "gpu_util": None}]
    text = report_summary.render_text(report_summary.summarize(records))
    assert "scaling forecast: none (report.json recorded no optimizer steps" in text


# -- the command line ----------------------------------------------------------------------
def run_cli(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    code = 0
    try:
        forecast.main(argv)
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_json_rows_and_a_plot(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    plot = tmp_path / "f.png"
    code, out, _ = run_cli(["--compute-ms", "300", "--params", "1e6", "--tensors", "8",
                            "--batch-size", "16", "--network", "25GbE", "--network", "NVLink",
                            "--sizes", "12", "--max-p", "64", "--json", "--plot", str(plot)],
                           capsys)
    assert code == 0
    rows = json.loads(out)
    sizes = sorted({r["ranks"] for r in rows if r["network"] == "25GbE"})
    assert sizes == [1, 2, 4, 8, 12, 16, 32, 64]
    assert max(r["ranks"] for r in rows if r["network"] == "NVLink") == 8    # inside a node
    assert {r["algorithm"] for r in rows} == {"ring", "ps"}   # hierarchical needs nodes
    if plot.exists():                                          # matplotlib is optional
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_table_from_a_report(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "report.json").write_text(json.dumps({"ranks": [rank(0)]}))
    code, out, _ = run_cli(["--report", str(tmp_path), "--ranks-per-node", "4", "--max-p",
                            "16", "--plot", ""], capsys)
    assert code == 0
    assert "compute 200 ms/step, 4 MB reduced/step in 3 buckets" in out
    assert "   16 | hierarchical |" in out and "25GbE (25 Gb/s Ethernet, TCP" in out


@pytest.mark.parametrize("argv,message", [
    (["--compute-ms", "100", "--params", "1e6", "--network", "Myrinet"],
     "--network 'Myrinet' is not a network"),
    (["--compute-ms", "100", "--params", "1e6", "--sizes", "0"], "P = 0: a forecast needs"),
    (["--compute-ms", "100", "--params", "1e6", "--max-p", "-4"], "P = -4"),
    (["--params", "1e6"], "needs --compute-ms"),
    (["--compute-ms", "100"], "needs --grad-bytes or --params"),
    (["--compute-ms", "100", "--params", "1e6", "--bandwidth", "10"], "go together"),
    (["--compute-ms", "100", "--params", "1e6", "--overlap", "1.5"], "overlap must be in"),
    (["--compute-ms", "100", "--grad-bytes", "12XB"], "--grad-bytes '12XB'"),
    (["--compute-ms", "100", "--params", "1e6", "--algorithms", "tree"], "'tree'"),
    (["--compute-ms", "100", "--params", "1e6", "--ranks-per-node", "0"], "at least 1"),
    (["--report", "/nonexistent/report.json"], "cannot read it"),
])
def test_bad_inputs_are_clear_errors(argv: list[str], message: str,
                                     capsys: pytest.CaptureFixture) -> None:
    code, out, err = run_cli([*argv, "--plot", ""], capsys)
    assert code == 2 and out == ""
    assert err.startswith("python -m hvdlite.forecast: error: ") and message in err


def test_a_report_missing_fields_names_them(tmp_path: Path,
                                            capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "report.json"
    path.write_text(json.dumps({"ranks": [{"rank": 0, "steps": 4, "compute_time_s": 0.1}]}))
    code, _, err = run_cli(["--report", str(path), "--plot", ""], capsys)
    assert code == 2 and "no 'allreduce_bytes'" in err and "--grad-bytes" in err
    path.write_text("{not json")
    code, _, err = run_cli(["--report", str(path), "--plot", ""], capsys)
    assert code == 2 and "is not JSON" in err


def test_a_report_that_reduced_nothing_asks_for_the_bytes() -> None:
    keras_alone = {"ranks": [rank(0, allreduce_bytes=0.0, allreduce_calls=0.0)]}
    with pytest.raises(ConfigError, match="reduced nothing.*--grad-bytes"):
        model.workload_from_report(keras_alone)
    assert model.workload_from_report(keras_alone, grad_bytes=8e6).buckets == 1


def test_this_machines_link_is_fitted_from_ring_times() -> None:
    from bench import forecast_check
    exact = {n: 2 * 5e-6 + n / 2e9 for n in (1 << 18, 1 << 20, 1 << 22)}   # P = 2
    link = forecast_check.fit_link(exact, 2)
    assert link.latency == pytest.approx(5e-6) and link.bandwidth == pytest.approx(2e9)
    rows = forecast_check.comm_table(link, {2: exact, 4: {1 << 20: 1e-3}})
    assert [round(r["error"], 6) for r in rows[:3]] == [0.0, 0.0, 0.0]
    assert rows[3]["forecast_s"] == pytest.approx(6 * 5e-6 + 1.5 * (1 << 20) / 2e9)


# -- nonsense in, a one-line error out (issue 34, item 6) ------------------------------------
def _report_file(tmp_path: Path, **fields: Any) -> str:
    path = tmp_path / "report.json"
    path.write_text(json.dumps({"ranks": [rank(0, **fields)]}))   # NaN, Infinity as Python writes
    return str(path)


@pytest.mark.parametrize("fields,message", [
    ({"allreduce_calls": float("nan")}, "rank 0's 'allreduce_calls' is nan"),
    ({"compute_time_s": float("inf")}, "rank 0's 'compute_time_s' is inf"),
    ({"allreduce_bytes": float("inf")}, "rank 0's 'allreduce_bytes' is inf"),
    ({"allreduce_calls": float("inf")}, "rank 0's 'allreduce_calls' is inf"),
    ({"step_time_sd_s": float("-inf")}, "rank 0's 'step_time_sd_s' is -inf"),
    ({"compute_time_s": True}, "rank 0's 'compute_time_s' is True"),
    ({"allreduce_calls": False}, "rank 0's 'allreduce_calls' is False"),
    ({"compute_time_s": "0.2"}, "rank 0's 'compute_time_s' is '0.2'"),
    ({"steps": -3}, "rank 0's 'steps' is -3"),
    ({"steps": True}, "rank 0's 'steps' is True"),
    ({"steps": 2.5}, "rank 0's 'steps' is 2.5"),
])
def test_a_report_with_nonsense_numbers_is_refused(tmp_path: Path, fields: dict[str, Any],
                                                    message: str,
                                                    capsys: pytest.CaptureFixture) -> None:
    code, out, err = run_cli(["--report", _report_file(tmp_path, **fields), "--plot", ""],
                             capsys)
    assert code == 2 and out == "", out + err
    assert err.startswith("python -m hvdlite.forecast: error: ") and message in err, err
    assert err.count("\n") == 1 and "Traceback" not in err, err


def test_a_binary_report_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "report.json"
    path.write_bytes(bytes(range(256)) * 4)
    code, out, err = run_cli(["--report", str(path), "--plot", ""], capsys)
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert f"--report {path} is not text (UTF-8)" in err, err


@pytest.mark.parametrize("argv,message", [
    (["--compute-ms", "inf", "--params", "1e6"], "compute time per step (s) must be above 0, a finite"),
    (["--compute-ms", "100", "--params", "inf"], "gradient bytes must be 0 or more, a finite"),
    (["--compute-ms", "100", "--params", "nan"], "gradient bytes must be 0 or more, a finite"),
    (["--compute-ms", "100", "--grad-bytes", "inf"], "--grad-bytes 'inf'"),
    (["--compute-ms", "100", "--params", "1e6", "--fusion-bytes", "inf"], "--fusion-bytes 'inf'"),
    (["--compute-ms", "100", "--params", "1e6", "--step-sd-ms", "inf"],
     "step time deviation (s) must be 0 or more, a finite"),
    (["--compute-ms", "100", "--params", "1e6", "--batch-size", "inf"], "batch size must be"),
    (["--compute-ms", "100", "--params", "1e6", "--bandwidth", "inf", "--latency", "1"],
     "--bandwidth must be a finite number above 0"),
    (["--compute-ms", "100", "--params", "1e6", "--bandwidth", "1", "--latency", "inf"],
     "--latency must be a finite number"),
    (["--compute-ms", "100", "--params", "1e6", "--ranks-per-node", "2", "--intra", "bogus"],
     "--intra 'bogus' is not a network"),
    (["--compute-ms", "100", "--params", "1e6", "--intra", "bogus"], "--intra 'bogus'"),
])
def test_infinite_and_misnamed_flags_are_refused(argv: list[str], message: str,
                                                 capsys: pytest.CaptureFixture) -> None:
    code, out, err = run_cli([*argv, "--plot", ""], capsys)
    assert code == 2 and out == "", out + err
    assert message in err and err.count("\n") == 1, err
    if "--intra" in message:
        assert "--network" not in err, err       # the flag given, not another one


def test_a_plot_path_that_cannot_be_written_fails_before_the_table(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    target = tmp_path / "missing" / "f.png"
    code, out, err = run_cli(["--compute-ms", "100", "--params", "1e6", "--max-p", "4",
                              "--plot", str(target)], capsys)
    assert code == 2 and out == "", out + err             # nothing printed for nothing
    assert f"--plot '{target}' cannot be used: its directory {target.parent} does not " \
           "exist" in err and err.count("\n") == 1, err


def test_a_plot_in_a_directory_is_drawn_inside_it(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture) -> None:
    folder = tmp_path / "plots"
    folder.mkdir()
    code, out, err = run_cli(["--compute-ms", "100", "--params", "1e6", "--max-p", "4",
                              "--plot", str(folder)], capsys)
    assert code == 0, err
    assert not (tmp_path / "plots.png").exists()
    pytest.importorskip("matplotlib")
    drawn = folder / "forecast.png"
    assert f"plot: {drawn}" in out and drawn.read_bytes()[:4] == b"\x89PNG", out


def test_a_plot_format_matplotlib_cannot_draw_fails_before_the_table(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("matplotlib")
    target = tmp_path / "f.xyz"
    code, out, err = run_cli(["--compute-ms", "100", "--params", "1e6", "--max-p", "4",
                              "--plot", str(target)], capsys)
    assert code == 2 and out == "" and not target.exists(), out + err
    assert "matplotlib draws no '.xyz' files" in err and err.count("\n") == 1, err
