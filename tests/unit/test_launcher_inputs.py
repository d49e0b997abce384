"""hvdliterun's inputs that used to hang or misuse the launcher (issue 34): slot and rank
counts without bounds, host names that ssh takes for options, numbers that are not
finite, and a discovery script whose background child holds its stdout."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from hvdlite.errors import ConfigError, HostDiscoveryError
from hvdlite.runner import elastic, function, launch
from tests.processes import alive

pytestmark = pytest.mark.timeout(60)


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """hvdliterun's usage error for ``argv`` (exit code 2): its last line."""
    with pytest.raises(SystemExit) as exited:
        launch.main(argv + ["--dry-run", "python", "train.py"])
    assert exited.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("hosts,problem", [
    ("localhost:99999999999999999999", "slots '99999999999999999999' is not between 1 and 4096"),
    ("node1:4097", "slots '4097' is not between 1 and 4096"),
    ("node1:0", "slots '0' is not between"),
    ("node1:²", "slots '²' is not a whole number"),
    ("-H:2", "host name '-H' begins with '-'"),
    ("node1:2,-oProxyCommand=x", "host name '-oProxyCommand=x' begins with '-'"),
    ("node 1:2", "host name 'node 1' has characters other than letters"),
    ("node1:2,", "the host name is empty"),
])
def test_bad_host_list_is_a_usage_error_naming_it(hosts: str, problem: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    error = _refused(["-np", "2", f"--hosts={hosts}"], capsys)
    assert error.startswith(f"hvdliterun: error: -H {hosts!r}: {problem}"), error
    assert "e.g. -H node1:4,node2:4" in error
    assert launch.main(["-np", "2", "-H", "node-1.example_a:4,10.0.0.2", "--dry-run", "x"]) == 0


@pytest.mark.parametrize("text,problem", [
    ("node1:2\nlocalhost:99999999999999999999\n", "line 2 'localhost:99999999999999999999': "
                                                  "slots '99999999999999999999' is not between"),
    ("# nodes\nnode1 slots=2\n-H slots=2\n", "line 3 '-H slots=2': host name '-H' begins"),
    ("node1 slots=0 max_slots=4\n", "line 1 'node1 slots=0 max_slots=4': slots '0'"),
    ("node1 max_slots=99999\n", "line 1 'node1 max_slots=99999': slots '99999'"),
    ("-oProxyCommand=x@node1\n", "user name '-oProxyCommand=x' is not a plain name"),
    ("# no host here\n\n", "names no host"),
])
def test_bad_hostfile_is_a_usage_error_naming_the_line(
        text: str, problem: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text(text)
    error = _refused(["-np", "2", "--hostfile", str(hostfile)], capsys)
    assert error.startswith(f"hvdliterun: error: --hostfile {hostfile} "), error
    assert problem in error, error
    # Both launchers' formats, comments and Open MPI's user@host pass.
    hostfile.write_text("node1:4  # MPICH\nnode2 slots=4 max_slots=8\nme@node3\n")
    assert launch.main(["-np", "2", "--hostfile", str(hostfile), "--dry-run", "x"]) == 0


@pytest.mark.parametrize("argv,problem", [
    (["-np", "-1"], "-np -1 is not between 1 and 1048576"),
    (["-np", "99999999999999999999"], "-np 99999999999999999999 is not between 1 and"),
    (["-np", "2", "--elastic", "--start-timeout", "nan"],
     "--start-timeout nan is not a finite number of seconds > 0"),
    (["-np", "2", "--elastic", "--start-timeout", "inf"], "--start-timeout inf is not a finite"),
    (["-np", "2", "--elastic", "--start-timeout", "0"], "--start-timeout 0 is not a finite"),
    (["-np", "2", "--stall-check-seconds", "nan"], "--stall-check-seconds nan is not a finite"),
    (["-np", "2", "--stall-shutdown-seconds", "-1"], "--stall-shutdown-seconds -1 is not"),
    (["-np", "2", "--cycle-time-ms", "inf"], "--cycle-time-ms inf is not a finite number of "
                                             "milliseconds >= 0"),
    (["-np", "2", "--fusion-threshold-mb", "nan"], "--fusion-threshold-mb nan is not a finite"),
    (["-np", "2", "--mpiexec", "/dev/null"], "--mpiexec /dev/null is not an executable file"),
])
def test_counts_and_numbers_out_of_bounds_are_usage_errors(
        argv: list[str], problem: str, capsys: pytest.CaptureFixture[str]) -> None:
    error = _refused(argv, capsys)
    assert error.startswith(f"hvdliterun: error: {problem}"), error


def test_hvdlite_run_refuses_a_bad_host_before_starting_anything(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="host name '-H' begins with '-'"):
        function._command(2, "-H:2", None, None, sys.executable, str(tmp_path))


@pytest.mark.parametrize("line,problem", [
    ("localhost:99999999999999999999", "slots '99999999999999999999' is not between 1 and 4096"),
    ("-H:2", "host name '-H' begins with '-'"),
    ("-oProxyCommand=x", "host name '-oProxyCommand=x' begins with '-'"),
    ("localhost:4097", "slots '4097' is not between"),
    ("localhost:²", "slots '²' is not a whole number"),
])
def test_discovery_line_out_of_bounds_names_the_script_and_line(line: str, problem: str) -> None:
    with pytest.raises(HostDiscoveryError) as raised:
        elastic.parse_hosts("discover.sh", f"node1:2\n{line}\n")
    assert str(raised.value).startswith(
        f"hvdliterun: discover.sh printed line 2 {line!r}, which is not 'host' or "
        f"'host:slots' ({problem}"), raised.value
    assert elastic.parse_hosts("s", "a:2\n\n b \n") == [("a", 2), ("b", 1)]


def _script(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\n" + body + "\n")
    script.chmod(0o755)
    return script


def _gone_soon(pid: int) -> bool:
    deadline = time.monotonic() + 30
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


def _end(pid_file: Path) -> None:
    """Ends the background process a test script started, if it is still there."""
    if pid_file.exists() and alive(int(pid_file.read_text())):
        os.kill(int(pid_file.read_text()), signal.SIGKILL)


def test_discovery_script_is_read_when_it_exits_not_at_eof(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A background child holding stdout open used to time the script out: the hosts
    are read while that child still runs."""
    monkeypatch.setattr(elastic, "_SCRIPT_TIMEOUT", 30.0)
    pid_file = tmp_path / "child.pid"
    script = _script(tmp_path, f"echo localhost:2\nsleep 300 &\necho $! > {pid_file}\n"
                               "echo node2:1")
    try:
        assert elastic._run_script(str(script)) == [("localhost", 2), ("node2", 1)]
        assert alive(int(pid_file.read_text()))        # the script's child is its business
    finally:
        _end(pid_file)


class _TimedOnceStarted(subprocess.Popen):
    """The script's process, whose wait (and so the script's time limit) starts only
    once the script has started its background child (written its pid file)."""
    pid_file: Path

    def wait(self, timeout: float | None = None) -> int:
        deadline = time.monotonic() + 60
        while not self.pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        return super().wait(timeout)


def test_discovery_script_that_hangs_is_killed_with_its_children(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(elastic, "_SCRIPT_TIMEOUT", 1.0)
    pid_file = tmp_path / "child.pid"
    monkeypatch.setattr(_TimedOnceStarted, "pid_file", pid_file, raising=False)
    monkeypatch.setattr(elastic, "subprocess", SimpleNamespace(
        Popen=_TimedOnceStarted, DEVNULL=subprocess.DEVNULL,
        TimeoutExpired=subprocess.TimeoutExpired))
    script = _script(tmp_path, f"sleep 300 &\necho $! > {pid_file}.new\n"
                               f"mv {pid_file}.new {pid_file}\necho localhost:2\n"
                               "exec sleep 300")
    try:
        with pytest.raises(HostDiscoveryError,
                           match=f"the host discovery script {script} did not exit within 1 s"):
            elastic._run_script(str(script))
        assert _gone_soon(int(pid_file.read_text()))
    finally:
        _end(pid_file)


@pytest.mark.parametrize("flags,named", [(["-H", "a:2"], "-H"), (["--hostfile", "h"], "--hostfile"),
                                         (["--mpiexec", sys.executable], "--mpiexec"),
                                         (["--elastic"], "--elastic")])
def test_gloo_refuses_what_it_cannot_do_naming_the_flag(
        flags: list[str], named: str, capsys: pytest.CaptureFixture[str],
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "h").write_text("localhost slots=2\n")
    message = _refused(["--gloo", "-np", "2", *flags], capsys)
    assert "hvdliterun --gloo" in message and named in message


def test_gloo_dry_run_is_torchrun_with_the_knobs_and_horovods_variables_per_rank(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert launch.main(["--gloo", "-np", "3", "--fusion-threshold-mb", "8", "--dry-run",
                        "python", "train.py", "--epochs", "2"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("env HVDLITE_FUSION_THRESHOLD=8.0MiB ")
    assert "-m hvdlite.runner.torchrun --standalone --nproc_per_node=3 --no-python" in line
    assert line.endswith("-m hvdlite.runner.gloo python train.py --epochs 2")


def test_horovods_variables_come_from_torchruns() -> None:
    from hvdlite.runner.gloo import horovod_variables
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
           "GROUP_RANK": "1"}
    assert horovod_variables(env) == {
        "HOROVOD_RANK": "5", "HOROVOD_SIZE": "8", "HOROVOD_LOCAL_RANK": "1",
        "HOROVOD_LOCAL_SIZE": "4", "HOROVOD_CROSS_RANK": "1", "HOROVOD_CROSS_SIZE": "2"}


@pytest.mark.parametrize("command,script", [
    (["python", "train.py", "--epochs", "2"], "train.py"),
    (["/usr/bin/python3.12", "-u", "-W", "ignore", "-X", "dev", "t.py"], "t.py"),
    (["python3", "-OB", "-Wignore", "--", "-odd.py"], "-odd.py"),
    (["python", "-m", "pkg.train"], None), (["python", "-um", "pkg.train"], None),
    (["python", "-c", "pass"], None), (["python", "-"], None), (["python", "--version"], None),
    (["python"], None), (["pythonic", "train.py"], None), (["./train.sh", "x.py"], None)])
def test_the_script_of_a_python_command_is_found_as_python_would(
        command: list[str], script: str | None) -> None:
    from hvdlite.runner.inputs import python_script
    assert python_script(command) == script


def test_torchruns_failure_gives_the_first_failed_ranks_exit_code() -> None:
    from types import SimpleNamespace
    from hvdlite.runner.torchrun import exit_code
    for code, job in [(3, 3), (-9, 137), (-15, 143)]:
        failure = SimpleNamespace(exitcode=code)
        assert exit_code(SimpleNamespace(get_first_failure=lambda: (1, failure))) == job


def test_torchrun_stopped_by_a_signal_exits_as_a_shell_says_it(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch.distributed")
    import torch.distributed.run
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from hvdlite.runner import torchrun

    def stopped(argv: list[str]) -> None:
        raise SignalException("Process 7 got signal: 2", sigval=signal.SIGINT)
    monkeypatch.setattr(torch.distributed.run, "main", stopped)
    assert torchrun.main(["--standalone", "x"]) == 128 + signal.SIGINT
    assert capsys.readouterr().err == ("torchrun: Process 7 got signal: 2; its workers were "
                                       "stopped\n")
