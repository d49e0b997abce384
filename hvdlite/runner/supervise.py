"""The launcher (mpiexec) run on hvdliterun's behalf: signals forwarded, and a launcher
that does not stop when told to is killed.

hvdliterun passes SIGINT and SIGTERM (a user's ^C, a scheduler's or ``timeout``'s kill)
and SIGUSR1 (preemption: the ranks stop at their next commit) on to the launcher. A
launcher can ignore them: MPICH's mpiexec stuck before starting any rank spins through
SIGTERM for ever. So after SIGINT or SIGTERM it has GRACE_SECONDS to end; then it is
killed (SIGKILL) with every process under it on this machine, whose ranks and proxies
would otherwise outlive it. After a launcher that failed, the files its MPI left on this
machine (a shared-memory segment in /dev/shm, hydra's /tmp file, the folder in TMPDIR
of an Open MPI mpirun that was killed) are removed (runner/leftovers.py). Should
hvdliterun itself be killed (SIGKILL: no handler runs), a watchdog process ends the
job and removes its scratch folders (runner/watchdog.py).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from typing import IO, Callable, Optional, Sequence

from hvdlite.runner import leftovers
from hvdlite.runner.watchdog import Watchdog, process_tree

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
_STOPPING = (signal.SIGINT, signal.SIGTERM)
# Time enough for a launcher to pass the signal on and reap its ranks (under a second on
# one host, a few through ssh); a scheduler that waits longer (SLURM's KillWait, 30 s)
# still finds the job gone when its own SIGKILL comes.
GRACE_SECONDS = 5.0

StderrReader = Callable[[IO[bytes]], None]


class Supervisor:
    """Runs launchers one at a time. ``interrupted`` once hvdliterun was told to stop
    (SIGINT or SIGTERM): the elastic loop then starts no other attempt."""

    def __init__(self, grace: float = GRACE_SECONDS) -> None:
        self.grace = grace
        self.interrupted = False
        self._child: Optional[subprocess.Popen[bytes]] = None
        self._pending: list[int] = []
        self._killer: Optional[threading.Timer] = None

    def run(self, command: list[str], read_stderr: Optional[StderrReader] = None,
            scratch: Sequence[str] = ()) -> int:
        """Runs ``command`` to its end: its exit code, 128 + N when signal N ended it (as
        a shell reports it), 127 when it could not be started. ``scratch``: folders the
        job uses, which the watchdog removes should hvdliterun die first."""
        previous = {s: signal.signal(s, self._forward) for s in FORWARDED}
        before = leftovers.present()
        code = 127
        launched: Optional[int] = None
        watchdog = Watchdog()
        try:
            for folder in scratch:
                watchdog.watch_folder(folder)
            try:
                self._child = subprocess.Popen(
                    command, stderr=subprocess.PIPE if read_stderr else None,
                    env=watchdog.environment(dict(os.environ)))
            except OSError as exc:
                _say(f"hvdliterun: the launcher {command[0]} could not be started ({exc}); "
                     "check --mpiexec and the arguments")
                return 127
            launched = self._child.pid
            watchdog.watch_process(launched)
            for signum in self._pending:    # came before the launcher existed
                self._forward(signum, None)
            reader = None
            if read_stderr is not None:
                reader = threading.Thread(target=read_stderr, args=(self._child.stderr,),
                                          daemon=True)
                reader.start()
            code = self._child.wait()
            if reader is not None:
                reader.join(timeout=5)      # a rank left running may hold the pipe open
            return code if code >= 0 else 128 - code
        finally:
            if self._killer is not None:
                self._killer.cancel()
            self._child, self._killer, self._pending = None, None, []
            for s, handler in previous.items():
                signal.signal(s, handler)
            if code != 0:
                leftovers.sweep(before)
                if launched is not None:
                    leftovers.remove_launcher_folders(launched)
            watchdog.release()

    def _forward(self, signum: int, frame: object) -> None:
        if signum in _STOPPING:
            self.interrupted = True
        child = self._child
        if child is None:
            self._pending.append(signum)
            return
        if child.poll() is not None:
            return
        child.send_signal(signum)
        if signum in _STOPPING and self._killer is None:
            self._killer = threading.Timer(self.grace, self._kill, args=(child, signum))
            self._killer.daemon = True
            self._killer.start()

    def _kill(self, child: subprocess.Popen[bytes], signum: int) -> None:
        if child.returncode is not None:
            return
        tree = process_tree(child.pid)
        for pid in tree:                     # the launcher first: it spawns no more
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:                  # gone meanwhile
                pass
        under = f" and {len(tree) - 1} process(es) under it" if len(tree) > 1 else ""
        _say(f"hvdliterun: the launcher {child.args[0]} did not stop within {self.grace:g} s "
             f"of {signal.Signals(signum).name}; killed it{under} (SIGKILL)")


def _say(text: str) -> None:
    sys.stderr.write(text + "\n")
    sys.stderr.flush()
