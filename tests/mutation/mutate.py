"""Mutation testing with cosmic-ray, driving the real tests of each module.

    python tests/mutation/mutate.py                      # every module in TESTS
    python tests/mutation/mutate.py hvdlite/engine/fusion.py [more modules]
    python tests/mutation/mutate.py --resume MODULE      # finish an interrupted run
    python tests/mutation/mutate.py --report MODULE      # print a finished run again
    python tests/mutation/mutate.py --workers 4 MODULE   # several mutants at once

(``make mutate`` and ``make mutate MODULE=... WORKERS=N`` run this under ``nice``.)
Each module is mutated in a scratch copy of the work tree (``.mutation/tree``), so
an interrupted run never leaves a mutant in your files. cosmic-ray applies one
mutant at a time and runs ``mutate.py --run-tests MODULE`` there: the stages listed
for the module in TESTS (tests/mutation/stages.py), cheapest first, stopping at the
first failure. A mutant is killed when a stage fails or exceeds the module's time
limit (a hang, unit stages included). Sessions and reports stay in ``.mutation/``.

Most modules' first stage runs in one process in seconds (the backends and the
executor over a fake communicator, the engine at one rank, the GPU backends over a
stand-in for CuPy), so only the mutants it misses cost mpiexec runs, and a module
takes minutes to well under an hour on two cores.

``--workers N`` runs N mutants at once, each in its own copy of the tree
(tests/mutation/parallel.py); ``--export DIR`` and ``--import DIR`` split that run
so that the mutants run on another machine (more cores, or a GPU).
"""
from __future__ import annotations

import argparse
import difflib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import parallel  # noqa: E402  (tests/mutation/parallel.py)
from stages import TESTS  # noqa: E402  (tests/mutation/stages.py: each module's tests)

ROOT = Path(__file__).resolve().parents[2]
WORK = ROOT / ".mutation"
TREE = WORK / "tree"
PY = sys.executable


def run_tests(module: str, mpiexec: str | None = None) -> int:
    """Run a module's stages in the current directory (cosmic-ray's test command)."""
    limit, stages = TESTS[module]
    for kind, args in stages:
        pytest = ["-x", "-q", "-p", "no:cacheprovider", *args.split()]
        if kind == "unit":
            command = ["timeout", "-k", "5", str(limit), PY, "-m", "pytest", *pytest]
        else:
            command = ["timeout", "-k", "5", str(limit),
                       mpiexec or str(Path(PY).with_name("mpiexec")), "-n", kind[3:], PY,
                       "tests/mpi/run.py", *pytest]
        code = subprocess.call(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if code != 0:
            print(f"killed by {kind} {args} (exit {code})")
            return 1
    return 0


def _copy_tree() -> None:
    """The work tree as git sees it (tracked and untracked, not ignored files)."""
    if TREE.exists():
        shutil.rmtree(TREE)
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                            check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            (TREE / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, TREE / name)
    (TREE / ".venv").symlink_to(ROOT / ".venv")


def _session(module: str) -> tuple[Path, Path]:
    slug = module.replace("/", ".").removesuffix(".py")
    return WORK / f"{slug}.toml", WORK / f"{slug}.sqlite"


def _cosmic_ray(*args: str) -> None:
    tool = str(Path(PY).with_name("cosmic-ray"))
    subprocess.run([tool, *args], cwd=TREE, check=True)


def _prepare(module: str, resume: bool, baseline: bool = True) -> None:
    """A fresh scratch tree, the unmutated tests passing in it, and a session to fill.
    (An export, or a run on parallel workers, leaves the baseline to each worker.)"""
    config, session = _session(module)
    _copy_tree()
    if baseline:
        print(f"== {module}: baseline (the unmutated tests must pass)", flush=True)
        if subprocess.call([PY, "tests/mutation/mutate.py", "--run-tests", module], cwd=TREE):
            sys.exit(f"{module}: the tests fail without any mutant; fix them first")
    if not (resume and session.exists()):
        config.write_text(
            "[cosmic-ray]\n"
            f'module-path = "{module}"\n'
            f"timeout = {float(_time_limit(module))}\n"
            "excluded-modules = []\n"
            f'test-command = "{PY} tests/mutation/mutate.py --run-tests {module}"\n\n'
            '[cosmic-ray.distributor]\nname = "local"\n')
        session.unlink(missing_ok=True)
        _cosmic_ray("init", str(config), str(session))


def _time_limit(module: str) -> int:
    """A whole test command's limit: each stage's own, and some slack."""
    limit, stages = TESTS[module]
    return limit * len(stages) + 30


def mutate(module: str, resume: bool, workers: int) -> None:
    # Parallel workers each check the baseline in their own copy first.
    _prepare(module, resume, baseline=workers <= 1)
    print(f"== {module}: running the mutants", flush=True)
    if workers <= 1:
        config, session = _session(module)
        _cosmic_ray("exec", str(config), str(session))
        return
    # Results of an interrupted run stay (one file per mutant, named by its job id).
    exported = WORK / f"{_session(module)[1].stem}.parallel"
    shutil.rmtree(exported / "mutants", ignore_errors=True)
    export(module, exported)
    parallel.run(exported, workers, None)
    import_results(module, exported)


def export(module: str, exported: Path) -> None:
    """Each mutant not yet run, as the whole mutated module, for tests/mutation/parallel.py."""
    from cosmic_ray.mutating import use_mutation
    from cosmic_ray.plugins import get_operator
    from cosmic_ray.work_db import WorkDB, use_db

    mutants = exported / "mutants"
    mutants.mkdir(parents=True, exist_ok=True)
    with use_db(str(_session(module)[1]), WorkDB.Mode.open) as db:
        for item in db.pending_work_items:
            (mutation,) = item.mutations
            operator = get_operator(mutation.operator_name)(**mutation.operator_args)
            with use_mutation(TREE / mutation.module_path, operator,
                              mutation.occurrence) as (original, mutated):
                if mutated is None:
                    continue
                (mutants / f"{item.job_id}.py").write_text(mutated)
                diff = difflib.unified_diff(original.splitlines(), mutated.splitlines(),
                                            f"a/{module}", f"b/{module}", lineterm="")
                (mutants / f"{item.job_id}.diff").write_text("\n".join(diff))
    (exported / "plan.json").write_text(json.dumps(
        {"module": module, "timeout": _time_limit(module)}))
    print(f"== {module}: {len(list(mutants.glob('*.py')))} mutants in {exported}")


def import_results(module: str, exported: Path) -> None:
    """Record parallel.py's outcomes in the module's cosmic-ray session."""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome, WorkResult

    with use_db(str(_session(module)[1]), WorkDB.Mode.open) as db:
        pending = {item.job_id for item in db.pending_work_items}
        for path in sorted((exported / "results").glob("*.json")):
            result = json.loads(path.read_text())
            if result["job"] not in pending:
                continue
            outcome = (TestOutcome.SURVIVED if result["outcome"] == "survived"
                       else TestOutcome.KILLED)
            db.set_result(result["job"], WorkResult(
                worker_outcome=WorkerOutcome.NORMAL, test_outcome=outcome,
                output=result["output"],
                diff=(exported / "mutants" / f"{result['job']}.diff").read_text()))


def report(module: str) -> tuple[int, int, int]:
    """Print and save the score and every surviving mutant; (killed, survived, pending)."""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import TestOutcome

    _, session = _session(module)
    killed, survivors, other = 0, [], 0
    with use_db(str(session), WorkDB.Mode.open) as db:
        for item, result in db.completed_work_items:
            if result.test_outcome == TestOutcome.SURVIVED:
                survivors.append((item, result))
            elif result.test_outcome in (TestOutcome.KILLED, TestOutcome.INCOMPETENT):
                killed += 1
            else:
                other += 1                      # skipped by a filter
        pending = sum(1 for _ in db.pending_work_items)
    done = killed + len(survivors)
    score = 100.0 * killed / done if done else 0.0
    lines = [f"{module}: {killed}/{done} mutants killed ({score:.1f}%), "
             f"{len(survivors)} survived, {pending} not run, {other} skipped"]
    for item, result in survivors:
        (mutation,) = item.mutations
        lines.append(f"-- survived: {mutation.operator_name} #{mutation.occurrence} at line "
                     f"{mutation.start_pos[0]}")
        lines.append((result.diff or "").strip())
    text = "\n".join(lines)
    print(text)
    (WORK / f"{session.stem}.report.txt").write_text(text + "\n")
    return killed, len(survivors), pending


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modules", nargs="*", help=f"default: {' '.join(TESTS)}")
    parser.add_argument("--run-tests", metavar="MODULE", help=argparse.SUPPRESS)
    parser.add_argument("--mpiexec", help=argparse.SUPPRESS)   # with --run-tests
    parser.add_argument("--resume", action="store_true", help="continue an interrupted run")
    parser.add_argument("--report", action="store_true", help="only print the last results")
    parser.add_argument("--workers", type=int, default=1,
                        help="mutants at once (tests/mutation/parallel.py); default 1")
    parser.add_argument("--export", type=Path, metavar="DIR",
                        help="write the mutants not yet run for parallel.py, elsewhere")
    parser.add_argument("--import", dest="imported", type=Path, metavar="DIR",
                        help="record the outcomes parallel.py left in DIR")
    args = parser.parse_args()
    if args.run_tests:
        sys.exit(run_tests(args.run_tests, args.mpiexec))
    modules = args.modules or list(TESTS)
    unknown = [m for m in modules if m not in TESTS]
    if unknown:
        sys.exit(f"no tests are mapped for {unknown}; add them to TESTS in tests/mutation/stages.py")
    WORK.mkdir(exist_ok=True)
    if args.export or args.imported:
        if len(modules) != 1:
            sys.exit("--export and --import take one module")
        if args.export:
            _prepare(modules[0], resume=True, baseline=False)
            export(modules[0], args.export)
            return
        import_results(modules[0], args.imported)
    totals = [0, 0]
    for module in modules:
        if not (args.report or args.imported):
            mutate(module, args.resume, args.workers)
        killed, survived, _ = report(module)
        totals[0] += killed
        totals[1] += survived
    if len(modules) > 1 and sum(totals):
        print(f"== total: {totals[0]}/{sum(totals)} killed "
              f"({100.0 * totals[0] / sum(totals):.1f}%)")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    main()
