"""``bench training``'s floors for real, at their smallest: the hand-fused loop with its
Allreduce handed to a helper thread (fused_handoff) and also agreed first in hvdlite's
negotiation round (fused_negotiated) run beside it under mpiexec, and the table gives
their ratios (a smoke run: the figures mean nothing at this size)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the training benchmark needs torch")
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(200)
def test_the_floors_train_beside_the_hand_fused_loop_and_print_their_ratios() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "training", "--np", "2", "--models", "mlp",
         "--methods", "hvdlite", "hand_fused", "fused_handoff", "fused_negotiated",
         "--rounds", "1", "--seconds", "0.2"],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"),
        capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    for method in ("fused_handoff", "fused_negotiated"):
        assert re.search(rf"{method}: +\d+\.\d", out), out
        assert re.search(rf"{method}: .*Allreduce +\d+\.\d", out), out
    assert re.search(r"negotiated/fused: \d+\.\d+x", out), out
    assert re.search(r"defaults/negotiated: \d+\.\d+x", out), out
