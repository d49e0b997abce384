"""What ends a job whose hvdliterun dies without ending it (SIGKILL from a batch system,
a user or the out-of-memory killer).

The launcher's ranks live in process sessions of their own (hydra's proxy and each rank
call setsid; torchrun starts each worker so), and no signal reaches them when
hvdliterun dies: they would run on, and the scratch folder hvdliterun made would stay
in TMPDIR. The kernel reports a death in one way every killer respects: it closes
the dead process's files. So hvdliterun starts this watchdog, a small process in a
session of its own (a ^C or a kill of hvdliterun's process group leaves it running),
whose stdin is a pipe whose only write end hvdliterun holds. hvdliterun writes on it
what the job is made of (``pid N``: the launcher; ``folder PATH``: a scratch folder)
and, once the job has ended the ordinary way (an exit, a ^C passed on), ``release``:
the watchdog then exits and touches nothing. End of file without ``release`` means
that hvdliterun died. The watchdog then SIGKILLs the job's processes on this machine,
found two ways, so that one that left the tree (an orphan is reparented to init) or
cleared its environment is still found:

- every process whose environment holds the job's token (``HVDLITERUN_JOB``, set in
  the launcher's environment and inherited by everything the launcher starts here);
- every process under the launcher's pid,

both read before any is killed. It then removes the scratch folders and the MPI files
and folders the killed job left (runner/leftovers.py), and says what it did on
hvdliterun's stderr.

Run as a script under ``python -I -S``: standard library only, quick to start, small
while it waits.
"""
from __future__ import annotations

import importlib.util
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Iterable, Optional

TOKEN_VARIABLE = "HVDLITERUN_JOB"
RELEASE = "release"
# Rounds of look-and-kill: a process forked while a round kills is found by the next.
_ROUNDS = 5
# How long the killed processes get to be gone before their files are swept: a SIGKILLed
# process ends within milliseconds; a loaded machine may take a few seconds to run it.
_GONE_WAIT_S = 10.0
_LEFTOVERS = Path(__file__).with_name("leftovers.py")


class Watchdog:
    """hvdliterun's side: ``environment()`` for the launcher, ``watch_*`` as the job
    grows, ``release()`` once it ended the ordinary way."""

    def __init__(self) -> None:
        self.token = secrets.token_hex(16)
        self._write: Optional[int] = None
        self._process: Optional[subprocess.Popen[bytes]] = None
        read, write = os.pipe()              # neither end is inherited by the launcher
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-I", "-S", os.path.abspath(__file__), self.token,
                 str(os.getpid())],
                stdin=read, stdout=subprocess.DEVNULL, close_fds=True,
                start_new_session=True,
                env={k: v for k, v in os.environ.items() if k != TOKEN_VARIABLE})
            self._write = write
        except OSError as exc:               # the job runs, unguarded against our death
            os.close(write)
            _say(f"hvdliterun: could not start the watchdog that ends the job if "
                 f"hvdliterun is killed ({exc}); starting the job without it")
        finally:
            os.close(read)

    def environment(self, base: dict[str, str]) -> dict[str, str]:
        """``base`` with the job's token: the launcher's environment."""
        return dict(base, **{TOKEN_VARIABLE: self.token})

    def watch_process(self, pid: int) -> None:
        self._send(f"pid {pid}")

    def watch_folder(self, path: str) -> None:
        self._send(f"folder {os.path.abspath(path)}")

    def release(self) -> None:
        """The job ended the ordinary way: the watchdog exits, touching nothing."""
        self._send(RELEASE)
        if self._write is not None:
            os.close(self._write)
            self._write = None
        if self._process is not None:
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:  # it only reads a pipe: never expected
                self._process.kill()
                self._process.wait()
            self._process = None

    def _send(self, line: str) -> None:
        if self._write is None:
            return
        try:
            os.write(self._write, (line + "\n").encode())   # < PIPE_BUF: one write
        except OSError:                      # the watchdog is gone: nothing to tell
            os.close(self._write)
            self._write = None


def _say(text: str) -> None:
    try:
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):            # no stderr left to say it on
        pass


# The watchdog process's side.

def process_tree(root: int) -> list[int]:
    """``root`` and the processes under it, parents first, from Linux's /proc (elsewhere
    ``root`` alone). Read before any is killed: an orphan's parent becomes init."""
    children: dict[int, list[int]] = {}
    for pid in _pids():
        try:
            with open(f"/proc/{pid}/stat", "rb") as handle:
                stat = handle.read()
        except OSError:                      # ended while we looked
            continue
        # "pid (name) state ppid ...": the name may hold spaces and ')'.
        fields = stat[stat.rfind(b")") + 2:].split()
        if len(fields) > 1:
            children.setdefault(int(fields[1]), []).append(pid)
    tree, index = [root], 0
    while index < len(tree):
        tree.extend(children.get(tree[index], []))
        index += 1
    return tree


def _pids() -> list[int]:
    try:
        return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]
    except OSError:                          # no /proc: no process found
        return []


def _carries(pid: int, marker: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as handle:
            return marker in handle.read().split(b"\0")
    except OSError:                          # ended, or another user's
        return False


def job_processes(token: str, roots: Iterable[int]) -> list[int]:
    """The processes of the job: those under ``roots`` (roots first), then those whose
    environment carries ``token``; never this one."""
    found: list[int] = []
    for root in roots:
        found += [pid for pid in process_tree(root) if pid not in found]
    marker = f"{TOKEN_VARIABLE}={token}".encode()
    found += [pid for pid in _pids() if pid not in found and _carries(pid, marker)]
    return [pid for pid in found if pid != os.getpid()]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            stat = handle.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:][:1] not in (b"Z", b"X")


def end_job(token: str, roots: list[int]) -> list[int]:
    """SIGKILL the job's processes until no new one is found; those killed, once gone
    (or after _GONE_WAIT_S)."""
    killed: list[int] = []
    for _ in range(_ROUNDS):
        found = [pid for pid in job_processes(token, roots) if pid not in killed]
        if not found:
            break
        for pid in found:                    # the launcher first: it starts no more
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except OSError:                  # gone meanwhile
                pass
    deadline = time.monotonic() + _GONE_WAIT_S
    while any(map(_alive, killed)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return killed


def _leftovers():
    """runner/leftovers.py, loaded by its path (this script runs without hvdlite)."""
    spec = importlib.util.spec_from_file_location("_hvdlite_leftovers", _LEFTOVERS)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def watch(token: str, orders: IO[str], launcher: int) -> int:
    """Read ``orders`` to its end; if it ends without ``release``, end the job that the
    process ``launcher`` (hvdliterun, or a caller of hvdlite.run) started."""
    leftovers = _leftovers()
    before = leftovers.present()
    roots: list[int] = []
    folders: list[str] = []
    for line in orders:
        word, _, value = line.rstrip("\n").partition(" ")
        if word == RELEASE:
            return 0
        if word == "pid":
            roots.append(int(value))
        elif word == "folder":
            folders.append(value)
    killed = end_job(token, roots)
    leftovers.sweep(before)
    for root in roots:
        leftovers.remove_launcher_folders(root)
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)
    removed = f"; removed {', '.join(folders)}" if folders else ""
    _say(f"hvdlite: the process that launched this job (pid {launcher}) died before the "
         f"job ended; its watchdog killed the job's {len(killed)} process(es) on this "
         f"machine (SIGKILL){removed}")
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # only the pipe's end ends the watch
    sys.exit(watch(sys.argv[1], sys.stdin, int(sys.argv[2])))
