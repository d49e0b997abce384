"""Run exported mutants on several workers at once, here or on a bigger machine.

cosmic-ray's ``exec`` runs one mutant at a time. A module whose mutants each need
mpiexec runs (the engine's) takes hours that way on a 2-core machine, so
``mutate.py`` can split a run in three:

    python tests/mutation/mutate.py --export DIR MODULE     # cosmic-ray writes the mutants
    python tests/mutation/parallel.py DIR --workers 7       # this file: the standard library only
    python tests/mutation/mutate.py --import DIR MODULE     # outcomes into cosmic-ray's session

and ``mutate.py --workers N MODULE`` does all three here. This file needs no
cosmic-ray, so the middle step runs wherever the tests run (a GPU machine with its
own Python): copy the tree with DIR in it, run this, bring DIR/results back.

Each worker mutates its own copy of the tree (DIR/trees/K) and runs the module's
stages there through ``mutate.py --run-tests``, exactly as cosmic-ray would, after
the unmutated module's (a failing baseline stops the run: no mutant is judged); a
stage that fails or runs past the time limit kills the mutant. One result file
per mutant (DIR/results/JOB.json), so an interrupted run resumes where it stopped.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[2]
# What a worker's copy of the tree leaves out: other environments and the run's own files.
_SKIP = {".git", ".whl", ".mutation", ".venv", ".venv-ompi", "__pycache__", ".pytest_cache"}


def _copy_tree(dest: Path, exported: Path) -> None:
    def ignore(folder: str, names: list[str]) -> set[str]:
        skipped = {n for n in names if n in _SKIP}
        return skipped | {n for n in names if Path(folder, n).resolve() == exported.resolve()}

    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(ROOT, dest, ignore=ignore, symlinks=True)
    if (ROOT / ".venv").exists():
        (dest / ".venv").symlink_to(ROOT / ".venv")


def _run_one(tree: Path, plan: dict, job: str, mutant: Optional[str],
             mpiexec: Optional[str]) -> dict:
    """One mutant's test command in ``tree`` (no mutant: the unmutated module)."""
    target = tree / plan["module"]
    original = target.read_text()
    target.write_text(original if mutant is None else mutant)
    command = [sys.executable, "tests/mutation/mutate.py", "--run-tests", plan["module"]]
    if mpiexec:
        command += ["--mpiexec", mpiexec]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(tree)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                       if p and Path(p).resolve() != ROOT.resolve()]))
    started = time.monotonic()
    try:
        done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True,
                              timeout=plan["timeout"])
        outcome = "survived" if done.returncode == 0 else "killed"
        output = (done.stdout + done.stderr)[-2000:]
    except subprocess.TimeoutExpired:
        outcome, output = "killed", f"timed out after {plan['timeout']} s"
    finally:
        target.write_text(original)
    return {"job": job, "outcome": outcome, "output": output,
            "seconds": round(time.monotonic() - started, 1)}


def run(exported: Path, workers: int, mpiexec: str | None) -> None:
    plan = json.loads((exported / "plan.json").read_text())
    results = exported / "results"
    results.mkdir(exist_ok=True)
    todo = [p for p in sorted((exported / "mutants").glob("*.py"))
            if not (results / f"{p.stem}.json").exists()]
    total, lock, started = len(todo), threading.Lock(), time.monotonic()
    print(f"{plan['module']}: {total} mutants on {workers} workers", flush=True)

    broken: list[str] = []

    def work(index: int) -> None:
        tree = exported / "trees" / str(index)
        _copy_tree(tree, exported)
        # Each copy's baseline first: tests that fail without a mutant (a missing
        # package, another machine's setup) would count every mutant as killed.
        baseline = _run_one(tree, plan, "baseline", None, mpiexec)
        if baseline["outcome"] != "survived":
            with lock:
                broken.append(baseline["output"])
                todo.clear()
            return
        while True:
            with lock:
                if not todo:
                    return
                path = todo.pop(0)
                number = total - len(todo)
            result = _run_one(tree, plan, path.stem, path.read_text(), mpiexec)
            (results / f"{path.stem}.json").write_text(json.dumps(result))
            print(f"[{number}/{total} {time.monotonic() - started:.0f}s] {path.stem}: "
                  f"{result['outcome']} ({result['seconds']} s)", flush=True)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    shutil.rmtree(exported / "trees", ignore_errors=True)
    if broken:
        sys.exit(f"the tests fail without any mutant in a worker's tree:\n{broken[0]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("exported", type=Path, help="a directory from mutate.py --export")
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                        help="mutants at once (default: half the cores; MPI stages use 2+)")
    parser.add_argument("--mpiexec", help="default: the one beside this Python")
    args = parser.parse_args()
    run(args.exported, args.workers, args.mpiexec)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    main()
