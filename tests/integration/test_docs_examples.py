"""The README's and the docs' code blocks run (see docs_examples for the markers):
a rename in the API fails here, not in a user's hands."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration import docs_examples
from tests.mpirun import mpiexec

ROOT = docs_examples.ROOT
PLAN = docs_examples.plan()

# Stands in for "train.py" (and "script.py") in the docs' launch lines.
TRAIN_PY = '''\
"""A small hvdlite job standing in for your training script in the docs' commands."""
import sys
import numpy as np
import hvdlite as hvd

hvd.init()
total = hvd.allreduce(np.ones(4), op=hvd.Sum, name="train")
print(f"train.py: rank {hvd.rank()} of {hvd.size()}, sum {total[0]:.0f}, args {sys.argv[1:]}",
      flush=True)
hvd.shutdown()
'''


def scratch(directory: Path) -> dict[str, str]:
    """A working directory that looks like a checkout with .venv made by make, and the
    environment the docs' commands assume."""
    for name in ("examples", "jobs", "hvdlite"):
        (directory / name).symlink_to(ROOT / name)
    (directory / "docs" / "images").mkdir(parents=True)   # pictures land here, not in docs/
    (directory / ".venv").symlink_to(Path(sys.prefix))
    for script in ("train.py", "script.py"):          # the docs' names for your program
        (directory / script).write_text(TRAIN_PY)
    # What the commands leave in TMPDIR (torchrun's torchelastic_* folders, TensorFlow's
    # autograph files) stays in the test's own directory, which pytest removes.
    (directory / "tmp").mkdir()
    return dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="2",
                TMPDIR=str(directory / "tmp"),
                PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")


def test_every_block_runs_or_says_why_not() -> None:
    assert not PLAN.problems, "\n".join(PLAN.problems)
    assert PLAN.programs and PLAN.shell


@pytest.mark.timeout(900)
def test_python_examples_run_on_two_ranks(tmp_path: Path) -> None:
    """Every Python program in one mpiexec -n 2 launch (the frameworks load once)."""
    missing = {name for name in ("torch", "tensorflow", "keras")
               if importlib.util.find_spec(name) is None}
    runnable = [p for p in PLAN.programs if not p.needs() & missing]
    entries = [{"where": p.where, "path": p.blocks[0].path, "source": p.source()}
               for p in runnable]
    programs = tmp_path / "programs.json"
    programs.write_text(json.dumps(entries))
    env = scratch(tmp_path)
    proc = subprocess.run([*mpiexec(2), sys.executable, "-m", "tests.integration.docs_examples",
                           str(programs)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=840)
    passed = proc.stdout.count("=== passed ")
    started = [line for line in proc.stdout.splitlines() if line.startswith("=== running ")]
    assert proc.returncode == 0 and passed == len(entries), (
        f"{passed} of {len(entries)} programs passed; the last started: "
        f"{started[-1] if started else 'none'}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    if missing:
        pytest.skip(f"{len(PLAN.programs) - len(runnable)} programs need {sorted(missing)}, "
                    "not installed here; the rest passed")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("block", PLAN.scripts, ids=[b.where for b in PLAN.scripts])
def test_script_examples_run(block: docs_examples.Block, tmp_path: Path) -> None:
    """Programs that start their own ranks (hvdlite.run), run as plain scripts."""
    script = tmp_path / "example.py"
    script.write_text("\n" * (block.line - 1) + block.code)
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=scratch(tmp_path),
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, f"{block.where}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("block", PLAN.shell, ids=[b.where for b in PLAN.shell])
def test_shell_examples_run(block: docs_examples.Block, tmp_path: Path) -> None:
    proc = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", block.code], cwd=tmp_path,
                          env=scratch(tmp_path), capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, f"{block.where}:\n{block.code}\n{proc.stdout[-3000:]}\n" \
                                 f"{proc.stderr[-3000:]}"
