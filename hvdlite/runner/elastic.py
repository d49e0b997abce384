"""``hvdliterun --elastic``: when the job fails, end it and start it again.

An MPI world cannot lose a rank and go on, so recovery is a restart: any rank's
failure ends the job (hvdlite aborts it, see ``hvdlite.failure.abort_on_error``), and this
loop starts it again, up to ``--max-restarts`` times, on the hosts that
``--host-discovery-script`` reports then (or the same ones): with fewer slots than
``-np`` (but at least ``--min-np``) the job resumes at a smaller world size, and
grows back, up to ``-np``, at a later restart when the slots return. The script's
``hvd.elastic.run`` resumes from the state committed in ``HVDLITE_ELASTIC_DIR``,
which this loop sets to a fresh directory per launch unless it is already set.

A job that exits with ``PREEMPTED_EXIT_CODE`` was asked to stop (SIGUSR1): it is
not restarted here, its code is returned for the scheduler to requeue it.
A deterministic error would print the same traceback at every attempt; each
error report is shown once, later repeats as one line.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import IO, Callable

from hvdlite.elastic.preemption import PREEMPTED_EXIT_CODE
from hvdlite.errors import ConfigError, HostDiscoveryError
from hvdlite.runner.inputs import MAX_SLOTS, check_number, parse_entry, shown
from hvdlite.runner.supervise import Supervisor

# An error report: hvdlite's "uncaught" header or a bare traceback, up to the exception line.
_REPORT_START = re.compile(r"^Traceback \(most recent call last\)|"
                           r"^\[hvdlite\] rank \d+ of \d+ on \S+: uncaught ")
_HEADER = re.compile(r"^\[hvdlite\] rank \d+ of \d+ on \S+: ")
# A discovery script that hangs must not hang the restart loop.
_SCRIPT_TIMEOUT = 60.0
# The most of a script's stdout or stderr read: a host list is small.
_SCRIPT_OUTPUT = 1 << 20


def add_arguments(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("elastic (restart on failure)")
    group.add_argument("--elastic", action="store_true",
                       help="restart the job when a rank fails (scripts use hvd.elastic.run)")
    group.add_argument("--max-restarts", type=int, default=3,
                       help="with --elastic: restarts before giving up (default 3)")
    group.add_argument("--min-np", type=int,
                       help="with --elastic: fewest ranks to start with (default -np)")
    group.add_argument("--host-discovery-script",
                       help="with --elastic: prints the usable hosts, one 'host[:slots]' a "
                            "line; run before every start")
    group.add_argument("--start-timeout", type=float, default=60.0,
                       help="with --elastic: seconds to wait for --min-np slots (default 60)")


def check_arguments(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    try:
        check_number("--start-timeout", args.start_timeout, "seconds", zero=False)
    except ConfigError as exc:
        p.error(str(exc))
    if not args.elastic:
        if args.min_np or args.host_discovery_script:
            p.error("--min-np and --host-discovery-script need --elastic")
        return
    if args.max_restarts < 0:
        p.error("--max-restarts must be >= 0")
    if args.min_np is not None and not 1 <= args.min_np <= args.np:
        p.error(f"--min-np must be between 1 and -np ({args.np})")
    if args.host_discovery_script and (args.hosts or args.hostfile):
        p.error("give --host-discovery-script or -H/--hostfile, not both")


def parse_hosts(script: str, text: str) -> list[tuple[str, int]]:
    """(host, slots) for each line of a discovery script's output ('host' or
    'host:slots'; blank lines are skipped). A line that is neither, or names a host
    or a slot count the launcher cannot take (hvdlite.runner.inputs), raises
    HostDiscoveryError naming the script and the line: a typo must not become a
    restart loop, a traceback from int() or a launcher that hangs."""
    hosts = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line:
            continue
        try:
            hosts.append(parse_entry(line))
        except ConfigError as exc:
            raise HostDiscoveryError(
                f"hvdliterun: {script} printed line {number} {shown(raw)}, which is not "
                f"'host' or 'host:slots' ({exc}); fix the script so that it prints one such "
                f"line per usable host (slots from 1 to {MAX_SLOTS})") from None
    return hosts


def discover(script: str, wanted: int, least: int, timeout: float) -> tuple[str, int]:
    """(hosts argument, ranks) from the discovery script: up to ``wanted`` ranks on the
    slots it reports, once it reports at least ``least``. Waits up to ``timeout``
    seconds for them (hosts may be on their way back); a script that fails or prints
    something that is not a host list raises HostDiscoveryError at once (waiting would
    not change it)."""
    deadline = time.monotonic() + timeout
    told = False
    while True:
        hosts = _run_script(script)
        slots = sum(count for _, count in hosts)
        if slots >= least:
            return ",".join(f"{host}:{count}" for host, count in hosts), min(wanted, slots)
        if time.monotonic() > deadline:
            raise HostDiscoveryError(
                f"hvdliterun: {script} reported {slots} slot(s) ({_listed(hosts)}) for "
                f"{timeout:g} s (--start-timeout); --min-np needs {least}. Bring hosts back, "
                "lower --min-np or raise --start-timeout")
        if not told:
            _say(f"hvdliterun: {script} reports {slots} slot(s), --min-np needs {least}; "
                 f"waiting up to {timeout:g} s (--start-timeout)")
            told = True
        time.sleep(1.0)


def _run_script(script: str) -> list[tuple[str, int]]:
    """The hosts ``script`` prints, read once it has exited. Its output goes to files,
    not pipes: a background process it leaves behind (a daemon, an ssh control master)
    holds its stdout open, and reading a pipe to its end would wait for that process."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        try:
            # Its own session: a script that hangs is killed with whatever it started.
            child = subprocess.Popen([script], stdin=subprocess.DEVNULL, stdout=out,
                                     stderr=err, start_new_session=True)
        except OSError as exc:
            raise HostDiscoveryError(f"hvdliterun: the host discovery script {script} could "
                                     f"not be run ({exc}); it must be an executable file that "
                                     "prints 'host:slots' lines and exits 0") from exc
        try:
            code = child.wait(timeout=_SCRIPT_TIMEOUT)
        except BaseException as exc:       # the timeout, or ^C while it runs
            _kill_session(child)
            if not isinstance(exc, subprocess.TimeoutExpired):
                raise
            raise HostDiscoveryError(f"hvdliterun: the host discovery script {script} did "
                                     f"not exit within {_SCRIPT_TIMEOUT:g} s; it must print "
                                     "'host:slots' lines and exit 0") from None
        stdout, stderr = _read(out), _read(err)
    if code != 0:
        detail = stderr.strip()[-500:] or "nothing on stderr"
        raise HostDiscoveryError(f"hvdliterun: the host discovery script {script} exited "
                                 f"with code {code} ({detail}); it must exit 0")
    return parse_hosts(script, stdout)


def _kill_session(child: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except OSError:                        # already gone
        pass
    child.wait()


def _read(handle: IO[bytes]) -> str:
    handle.seek(0)
    return handle.read(_SCRIPT_OUTPUT).decode("utf-8", "replace")


def _listed(hosts: list[tuple[str, int]]) -> str:
    return ", ".join(f"{host}:{count}" for host, count in hosts) or "no hosts"


def run_elastic(args: argparse.Namespace,
                build_command: Callable[[argparse.Namespace], list[str]]) -> int:
    own_dir = None
    if not os.environ.get("HVDLITE_ELASTIC_DIR"):
        own_dir = tempfile.mkdtemp(prefix="hvdlite-elastic-")
        os.environ["HVDLITE_ELASTIC_DIR"] = own_dir
    code = 1
    try:
        code = _attempts(args, build_command)
        return code
    finally:
        if own_dir is not None and code == PREEMPTED_EXIT_CODE:
            _say(f"hvdliterun: preempted; the last commit is in {own_dir}: run again with "
                 f"HVDLITE_ELASTIC_DIR={own_dir} to resume")
        elif own_dir is not None:
            shutil.rmtree(own_dir, ignore_errors=True)


def _attempts(args: argparse.Namespace,
              build_command: Callable[[argparse.Namespace], list[str]]) -> int:
    runner, reports = Supervisor(), _Reports()
    code = 1
    # -np is the most ranks: each start takes what the discovery script offers then,
    # up to it, so a job that shrank when a host left grows again when it is back.
    wanted, least = args.np, args.min_np or args.np
    for attempt in range(args.max_restarts + 1):
        if args.host_discovery_script:
            previous = args.np
            try:
                args.hosts, args.np = discover(args.host_discovery_script, wanted, least,
                                               args.start_timeout)
            except HostDiscoveryError as exc:
                _say(str(exc))
                return code if code != 0 else 1
            if attempt and args.np != previous:
                _say(f"hvdliterun: the world changes from {previous} to {args.np} rank(s) "
                     f"({args.hosts}); the job resumes from the last commit at that size")
        code = runner.run(build_command(args), reports.filter)
        if code == 0 or code == PREEMPTED_EXIT_CODE or runner.interrupted:
            return code
        if attempt < args.max_restarts:
            _say(f"hvdliterun: the job failed (exit code {code}); restart {attempt + 1} of "
                 f"{args.max_restarts}, resuming from the last commit")
    _say(f"hvdliterun: giving up after {args.max_restarts} restart(s) (--max-restarts); "
         f"the job's last exit code was {code}. The error is reported above.")
    return code


class _Reports:
    """Filters a launch's stderr: shows each distinct error report once."""

    def __init__(self) -> None:
        self.seen: set[str] = set()

    def filter(self, stream: IO[bytes]) -> None:
        block: list[str] = []
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", "replace")
            if block:
                block.append(line)
                if _ends_report(line):
                    self._emit_report(block)
                    block = []
            elif _REPORT_START.search(line):
                block = [line]
            else:
                _write(line)
        if block:
            self._emit_report(block)

    def _emit_report(self, block: list[str]) -> None:
        key = "".join(_HEADER.sub("", line) for line in block)
        if key in self.seen:
            kind = block[-1].split(":", 1)[0].strip()[:100]
            _write(f"hvdliterun: the same {kind} as in an earlier attempt (not shown again)\n")
            return
        self.seen.add(key)
        _write("".join(block))


def _ends_report(line: str) -> bool:
    """The exception line ends a traceback: not indented, not a chaining note."""
    text = line.rstrip("\n")
    return bool(text) and not text[0].isspace() and not text.startswith(
        ("Traceback", "During handling", "The above exception", "[hvdlite]"))


def _write(text: str) -> None:
    sys.stderr.write(text)
    sys.stderr.flush()


def _say(text: str) -> None:
    _write(text + "\n")
