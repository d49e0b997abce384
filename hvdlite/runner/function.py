"""``hvdlite.run(fn, args, kwargs, np=...)``: Horovod's ``horovod.run``.

Runs ``fn(*args, **kwargs)`` on ``np`` ranks through the same launcher as
``hvdliterun`` and returns the results as a list indexed by rank.

How ``fn`` travels (no cloudpickle): by reference, as its module and qualified
name, so it must be defined at the top level of a module, or of the main script
(which each rank then imports under another name, as multiprocessing's spawn
does: keep the script's own work under ``if __name__ == "__main__":``).
Lambdas and nested functions are refused. The arguments and the results are
pickled, so they must be picklable.

A caller killed while the job runs takes the job with it (runner/watchdog.py).

``python -m hvdlite.runner.function DIR`` is the rank side.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from hvdlite.errors import HvdliteError, UsageError

_MAIN_ALIAS = "__hvdlite_main__"


def run(func: Callable[..., Any], args: Sequence[Any] = (), kwargs: Optional[dict] = None,
        num_proc: Optional[int] = None, hosts: Optional[str] = None,
        hostfile: Optional[str] = None, executable: Optional[str] = None,
        np: Optional[int] = None, mpiexec: Optional[str] = None,
        env: Optional[dict[str, str]] = None) -> list[Any]:
    """Run ``func`` on ``np`` (or ``num_proc``) ranks and return its results by rank.

    Raises UsageError for a function that cannot be found by reference or an input the
    launcher cannot take (ConfigError: hosts, hostfile, np, mpiexec), and
    HvdliteError when the job fails (its output, with the traceback, is above).
    """
    count = num_proc if num_proc is not None else (np if np is not None else 1)
    if count < 1:
        raise UsageError(f"hvdlite.run needs at least one process, got np={count}")
    reference = _reference(func)
    with tempfile.TemporaryDirectory(prefix="hvdlite-run-") as folder:
        with open(Path(folder) / "call.pkl", "wb") as handle:
            pickle.dump(reference, handle)      # first: the rank resolves it before
            pickle.dump((tuple(args), dict(kwargs or {})), handle)   # unpickling these
        command = _command(count, hosts, hostfile, mpiexec, executable or sys.executable, folder)
        child_env = dict(os.environ if env is None else env)
        child_env["PYTHONPATH"] = os.pathsep.join(p for p in [os.getcwd(), *sys.path] if p)
        code = _launch(command, child_env, folder)
        if code != 0:
            raise HvdliteError(f"hvdlite.run: the job of {count} ranks failed with exit code "
                               f"{code}; its output above shows why")
        return [_result(Path(folder), rank) for rank in range(count)]


def _launch(command: list[str], env: dict[str, str], folder: str) -> int:
    """Run the job to its end; its exit code. A watchdog ends it and removes ``folder``
    should this process be killed first (hvdlite/runner/watchdog.py)."""
    from hvdlite.runner.watchdog import Watchdog
    watchdog = Watchdog()
    try:
        watchdog.watch_folder(folder)
        with subprocess.Popen(command, env=watchdog.environment(env)) as child:
            watchdog.watch_process(child.pid)
            try:
                return child.wait()
            except BaseException:            # ^C: the job goes with its caller
                child.kill()
                raise
    finally:
        watchdog.release()


def _reference(func: Callable[..., Any]) -> tuple[str, str, Optional[str]]:
    """(module, qualified name, main script path or None)."""
    qualname = getattr(func, "__qualname__", "")
    module = getattr(func, "__module__", None)
    if not module or not qualname or "<" in qualname:
        raise UsageError(f"hvdlite.run sends the function by reference, so it must be defined "
                         f"at the top level of a module or script; {func!r} is not")
    main_path = None
    if module == "__main__":
        main_path = getattr(sys.modules["__main__"], "__file__", None)
        if main_path is None:
            raise UsageError("hvdlite.run cannot send a function defined in an interactive "
                             "session; define it in a module or script file")
        main_path = os.path.abspath(main_path)
    return module, qualname, main_path


def _command(count: int, hosts: Optional[str], hostfile: Optional[str],
             mpiexec: Optional[str], python: str, folder: str) -> list[str]:
    from hvdlite.runner import launch
    argv = ["-np", str(count)]
    # flag=value: a value beginning with '-' would be taken for a flag of its own
    argv += [f"--hosts={hosts}"] if hosts else []
    argv += [f"--hostfile={hostfile}"] if hostfile else []
    argv += [f"--mpiexec={mpiexec}"] if mpiexec else []
    argv += [python, "-m", "hvdlite.runner.function", folder]
    args = launch.parser().parse_args(argv)
    launch.check_arguments(args)        # ConfigError (a UsageError) names a bad input
    return launch.build_command(args)


def _result(folder: Path, rank: int) -> Any:
    path = folder / f"result.{rank}.pkl"
    if not path.exists():
        raise HvdliteError(f"hvdlite.run: rank {rank} returned no result")
    with open(path, "rb") as handle:
        return pickle.load(handle)


def _resolve(module: str, qualname: str, main_path: Optional[str]) -> Callable[..., Any]:
    if main_path is not None:
        spec = importlib.util.spec_from_file_location(_MAIN_ALIAS, main_path)
        loaded = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        sys.modules[_MAIN_ALIAS] = loaded
        spec.loader.exec_module(loaded)  # type: ignore[union-attr]
        sys.modules["__main__"] = loaded     # so pickled arguments of __main__ classes load
        target: Any = loaded
    else:
        target = importlib.import_module(module)
    for part in qualname.split("."):
        target = getattr(target, part)
    return target


def _this_rank() -> int:
    from hvdlite.api import runtime
    if runtime.is_initialized():
        return runtime.rank()
    for variable in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        if variable in os.environ:
            return int(os.environ[variable])
    from mpi4py import MPI
    return MPI.COMM_WORLD.Get_rank()


def _rank_main(folder: str) -> None:
    with open(Path(folder) / "call.pkl", "rb") as handle:
        module, qualname, main_path = pickle.load(handle)
        func = _resolve(module, qualname, main_path)
        args, kwargs = pickle.load(handle)
    result = func(*args, **kwargs)
    rank = _this_rank()
    temporary = Path(folder) / f".result.{rank}.tmp"
    with open(temporary, "wb") as handle:
        pickle.dump(result, handle)
    os.replace(temporary, Path(folder) / f"result.{rank}.pkl")


if __name__ == "__main__":
    _rank_main(sys.argv[1])
