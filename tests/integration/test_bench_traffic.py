"""``python -m bench traffic --json`` under mpiexec: one JSON list whose
measured bytes equal the textbook formulas exactly, and a plot."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MPIEXEC = str(Path(sys.executable).with_name("mpiexec"))


@pytest.mark.timeout(200)     # above the job's own limit, 180 s
@pytest.mark.parametrize("np", [2, 4])
def test_traffic_bench_matches_the_formulas(np: int, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    plot = tmp_path / "traffic.png"
    proc = subprocess.run(
        [MPIEXEC, "-n", str(np), sys.executable, "-m", "bench", "traffic", "--json",
         "--mib", "0.25", "--seconds", "0.01", "--plot", str(plot)],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True,
        text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(proc.stdout)
    by_name = {row["algorithm"]: row for row in rows}
    assert set(by_name) == {"ps", "ring", "mpi"}
    n = by_name["ps"]["nbytes"]
    assert n % (4 * np) == 0
    assert by_name["ps"]["sent_per_rank"] == by_name["ps"]["received_per_rank"] == n * (np - 1)
    assert by_name["ps"]["sent_least_rank"] == n                    # a worker
    assert by_name["ring"]["sent_per_rank"] == by_name["ring"]["received_per_rank"] \
        == 2 * n * (np - 1) // np == by_name["ring"]["sent_least_rank"]
    for row in rows:
        assert row["np"] == np and row["time_s"] > 0
        assert row["formula_bytes"] == row["sent_per_rank"]       # None == None for mpi
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
