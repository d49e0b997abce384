"""A ZeroRedundancyOptimizer committed by the elastic TorchState at one world size and
resumed from HVDLITE_ELASTIC_DIR at another (2 -> 4, 4 -> 2): the optimizer state is
resharded, and the job ends at an uninterrupted run's parameters (float64, within
1e-12: only the order of summation differs between world sizes). The training
program is tests/integration/zero_elastic_job.py."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.mpirun import run_module

pytest.importorskip("torch")
pytestmark = pytest.mark.timeout(300)
MODULE = "tests.integration.zero_elastic_job"
STEPS = 6


def _run(np: int, directory: Path, stop: int, out: Path) -> dict:
    proc = run_module(np, MODULE, {"HVDLITE_ELASTIC_DIR": str(directory),
                                   "ZERO_STOP": str(stop), "ZERO_OUT": str(out)}, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(out.read_text())


@pytest.mark.parametrize("first,then", [(2, 4), (4, 2)], ids=["2to4", "4to2"])
def test_resumed_at_another_world_size_ends_as_uninterrupted(tmp_path: Path, first: int,
                                                             then: int) -> None:
    reference = _run(2, tmp_path / "reference", STEPS, tmp_path / "reference.json")
    assert reference["resumed_from"] == 0
    directory = tmp_path / "resized"
    _run(first, directory, STEPS // 2, tmp_path / "first.json")
    resumed = _run(then, directory, STEPS, tmp_path / "then.json")
    assert (resumed["size"], resumed["resumed_from"]) == (then, STEPS // 2)
    for index, (got, want) in enumerate(zip(resumed["parameters"], reference["parameters"])):
        worst = max(abs(a - b) for a, b in zip(got, want))
        assert worst <= 1e-12, f"parameter {index}: off by {worst}"
