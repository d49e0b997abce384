"""How a job started by hvdliterun ends, under MPI and under --gloo (torchrun): with the
ranks' exit code; with one line and 127 when its program does not exist; and with no
rank left running and no scratch folder left in TMPDIR when hvdliterun itself is
SIGKILLed (a batch system, the out-of-memory killer).

The ranks are plain Python programs, not hvdlite ones: what is under test is the
launcher, and each launch costs seconds."""
from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hvdlite.runner.supervise import process_tree
from tests.processes import alive

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(180)
TRANSPORTS = {"mpi": [], "gloo": ["--gloo"]}
NO_TORCH = pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                              reason="hvdliterun --gloo needs torch")
# A rank that says it started (a file named by its pid), then waits for ever.
BLOCK = ("import os, signal, sys\n"
         "open(os.path.join(sys.argv[1], f'pid.{os.getpid()}'), 'w').close()\n"
         "while True:\n"
         "    signal.pause()\n")
# The last rank exits with status 3 at once; the others wait, until the launcher ends them
# (torchrun ends a job at a worker's failure; hydra waits for every rank, so there each
# rank exits 3).
EXIT_3 = ("import os, signal, sys\n"
          "if sys.argv[1] == 'every' or int(os.environ['RANK']) == int(os.environ['WORLD_SIZE']) - 1:\n"
          "    sys.exit(3)\n"
          "while True:\n"
          "    signal.pause()\n")


def _environment(tmp_path: Path) -> dict[str, str]:
    scratch = tmp_path / "tmpdir"
    scratch.mkdir(exist_ok=True)
    return dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", TMPDIR=str(scratch))


def _hvdliterun(transport: str, np: int, *command: str) -> list[str]:
    return [sys.executable, "-m", "hvdlite.run", *TRANSPORTS[transport], "-np", str(np),
            *command]


def _started(folder: Path, np: int, proc: subprocess.Popen[str], timeout: float = 120
             ) -> list[int]:
    """The ranks' pids, once every rank has said it started."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = [int(path.name.split(".")[1]) for path in folder.glob("pid.*")]
        if len(pids) == np:
            return pids
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    raise AssertionError(f"{np} ranks did not start within {timeout} s")


def _gone(pids: list[int], timeout: float) -> list[int]:
    """Those of ``pids`` still running after ``timeout`` s (none: at once when all end)."""
    deadline = time.monotonic() + timeout
    while (running := [pid for pid in pids if alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return running


# -n 4 under MPI only: a torchrun launch costs 10-20 s on a loaded machine.
CASES = [("mpi", 2), ("mpi", 4), pytest.param("gloo", 2, marks=NO_TORCH)]


@pytest.mark.parametrize("transport,np", CASES)
def test_a_sigkilled_hvdliterun_takes_its_ranks_and_scratch_folder_with_it(
        transport: str, np: int, tmp_path: Path) -> None:
    ranks = tmp_path / "ranks"
    ranks.mkdir()
    env = _environment(tmp_path)
    proc = subprocess.Popen(_hvdliterun(transport, np, sys.executable, "-c", BLOCK,
                                        str(ranks)),
                            cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        ranks_pids = _started(ranks, np, proc)
        # The launcher (mpiexec or torchrun) and all under it, the watchdog, the ranks.
        pids = sorted(set(process_tree(proc.pid)[1:] + ranks_pids))
        proc.kill()
        proc.wait()
        # Generous: the promise is seconds; a loaded machine may take a few more.
        assert _gone(pids, timeout=30) == [], "processes outlived their SIGKILLed hvdliterun"
        # The watchdog writes its last words on hvdliterun's stderr, then closes it.
        _, err = proc.communicate(timeout=30)
        assert (f"the process that launched this job (pid {proc.pid}) died before the job "
                "ended; its watchdog killed the job's") in err, err
        assert list(Path(env["TMPDIR"]).iterdir()) == [], err
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def block_rank(folder: str) -> None:
    """A rank of hvdlite.run's job: says it started, then waits for ever."""
    open(os.path.join(folder, f"pid.{os.getpid()}"), "w").close()
    while True:
        signal.pause()


def test_a_sigkilled_caller_of_hvdlite_run_takes_its_ranks_and_folder_with_it(
        tmp_path: Path) -> None:
    ranks = tmp_path / "ranks"
    ranks.mkdir()
    env = _environment(tmp_path)
    caller = ("import sys, hvdlite\n"
              "from tests.integration.test_launcher_end import block_rank\n"
              "hvdlite.run(block_rank, args=(sys.argv[1],), np=2)\n")
    proc = subprocess.Popen([sys.executable, "-c", caller, str(ranks)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        ranks_pids = _started(ranks, 2, proc)
        pids = sorted(set(process_tree(proc.pid)[1:] + ranks_pids))
        proc.kill()
        proc.wait()
        assert _gone(pids, timeout=30) == [], "processes outlived hvdlite.run's caller"
        _, err = proc.communicate(timeout=30)
        assert (f"the process that launched this job (pid {proc.pid}) died before the job "
                "ended; its watchdog killed the job's") in err, err
        assert list(Path(env["TMPDIR"]).iterdir()) == [], err    # hvdlite-run-* is gone
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("transport,np", CASES)
def test_the_exit_code_is_the_failed_ranks(transport: str, np: int, tmp_path: Path) -> None:
    which = "every" if transport == "mpi" else "last"
    done = subprocess.run(_hvdliterun(transport, np, sys.executable, "-c", EXIT_3, which),
                          cwd=ROOT, env=_environment(tmp_path), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 3, done.stdout + done.stderr


@pytest.mark.parametrize("command,named", [
    (["no-such-program-here", "--epochs", "1"], "the program 'no-such-program-here' is not on PATH"),
    (["./no-such-program"], "the program ./no-such-program is not an executable file"),
    ([sys.executable, "-u", "no_such_script.py"], "script no_such_script.py does not exist")],
    ids=["on PATH", "a path", "python's script"])
@pytest.mark.parametrize("transport", ["mpi", pytest.param("gloo", marks=NO_TORCH)])
def test_a_program_that_does_not_exist_is_one_line_and_127_before_any_rank_starts(
        transport: str, command: list[str], named: str, tmp_path: Path) -> None:
    done = subprocess.run(_hvdliterun(transport, 2, *command), cwd=ROOT,
                          env=_environment(tmp_path), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 127, done.stdout + done.stderr
    assert done.stderr.startswith("hvdliterun: error: ") and named in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1 and done.stdout == "", done.stdout + done.stderr


def test_a_gloo_rank_that_cannot_start_its_program_says_so_in_one_line() -> None:
    """What a rank says where the program went missing after hvdliterun looked for it."""
    done = subprocess.run([sys.executable, "-m", "hvdlite.runner.gloo", "no-such-program-here"],
                          cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT), RANK="1"),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 127, done.stderr
    assert done.stderr == ("hvdliterun --gloo: rank 1 could not start no-such-program-here: "
                           "No such file or directory\n"), done.stderr
