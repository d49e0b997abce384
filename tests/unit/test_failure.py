"""How one failing rank ends the job, in-process: MPI_Abort, os._exit and the clock
are fakes that record, so each path can be followed without ending the test.
(A sys.exit status recorded at real interpreter exit is in test_liveness.py.)"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import pytest

from hvdlite.failure import abort_on_error
from hvdlite.transport.mpi_transport import MpiTransport

ROOT = Path(__file__).resolve().parents[2]


class Aborted(Exception):
    """What the fake os._exit raises, so a test goes on after an 'exit'."""


class Ends:
    """The fakes behind abort_now: MPI_Abort and os._exit, recorded in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []
        self.abort_raises = False

    def Abort(self, status: int) -> None:  # noqa: N802 (mpi4py's name)
        self.calls.append(("Abort", status))
        if self.abort_raises:
            raise RuntimeError("MPI is gone")

    def _exit(self, status: int) -> None:
        self.calls.append(("_exit", status))
        raise Aborted(status)


@pytest.fixture
def ends(monkeypatch: pytest.MonkeyPatch) -> Iterator[Ends]:
    """A abort_on_error module whose aborts and exits are recorded, whose sleeps are
    recorded, and whose state is restored after the test."""
    fake = Ends()
    # The world as init() leaves it before install(): MPI's, whose abort is recorded.
    monkeypatch.setattr(abort_on_error, "_abort_world", fake.Abort)
    monkeypatch.setattr(abort_on_error, "os", SimpleNamespace(write=os.write, fsync=os.fsync,
                                                      _exit=fake._exit))
    monkeypatch.setattr(abort_on_error, "time", SimpleNamespace(sleep=lambda s: fake.calls.append(
        ("sleep", s))))  # type: ignore[arg-type]
    monkeypatch.setattr(abort_on_error, "socket", SimpleNamespace(gethostname=lambda: "node7"))
    for name, value in (("_installed", False), ("_who", None), ("_exit_status", None),
                        ("_broken", None), ("_lost_rank_wait", MpiTransport.lost_rank_wait)):
        monkeypatch.setattr(abort_on_error, name, value)
    yield fake


@pytest.mark.parametrize("code,status", [(None, 0), (0, 0), (3, 3), (256, 0), (257, 1),
                                         (-1, 255), (True, 1), ("bad input", 1)])
def test_the_status_python_derives_from_a_sys_exit_code(code: object, status: int) -> None:
    assert abort_on_error._status(code) == status


def test_abort_now_ends_the_process_even_when_mpi_abort_returns_or_fails(ends: Ends) -> None:
    with pytest.raises(Aborted):
        abort_on_error.abort_now(3)
    assert ends.calls == [("Abort", 3), ("_exit", 3)]
    ends.calls.clear()
    ends.abort_raises = True
    with pytest.raises(Aborted):
        abort_on_error.abort_now(4)
    assert ends.calls == [("Abort", 4), ("_exit", 4)]


def test_emit_writes_to_fd_2_after_what_python_buffered_then_waits(
        ends: Ends, capfd: pytest.CaptureFixture) -> None:
    print("buffered", end="")
    abort_on_error.emit("the traceback\n", grace=0.25)
    out, err = capfd.readouterr()
    assert out == "buffered" and err == "the traceback\n"
    assert ends.calls == [("sleep", 0.25)]
    abort_on_error.emit("x")
    assert abort_on_error.ABORT_GRACE_S > 0
    assert ends.calls[-1] == ("sleep", abort_on_error.ABORT_GRACE_S)


def test_emit_survives_a_closed_stream(ends: Ends, capfd: pytest.CaptureFixture,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    class Closed:
        def flush(self) -> None:
            raise ValueError("I/O operation on closed file")

    monkeypatch.setattr(sys, "stdout", Closed())
    abort_on_error.emit("still written\n", grace=0.0)
    assert capfd.readouterr().err == "still written\n"


def test_emit_flushes_python_s_streams_before_writing_and_syncs_fd_2(
        ends: Ends, monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []

    class Stream:
        def __init__(self, name: str) -> None:
            self.name = name

        def flush(self) -> None:
            events.append(f"flush {self.name}")

    def write(fd: int, data: bytes) -> int:
        events.append(f"write {fd}")
        return len(data)

    monkeypatch.setattr(sys, "stdout", Stream("stdout"))
    monkeypatch.setattr(sys, "stderr", Stream("stderr"))
    monkeypatch.setattr(abort_on_error, "os", SimpleNamespace(
        write=write, fsync=lambda fd: events.append(f"fsync {fd}")))
    abort_on_error.emit("text", grace=0.0)
    assert events == ["flush stdout", "flush stderr", "write 2", "fsync 2"]


def test_emit_writes_all_of_a_long_text_and_survives_a_broken_fd_2(
        ends: Ends, monkeypatch: pytest.MonkeyPatch) -> None:
    written: list[bytes] = []

    def write_some(fd: int, data: bytes) -> int:    # a pipe takes a few bytes at a time
        assert fd == 2
        written.append(bytes(data[:3]))
        return min(3, len(data))

    def refuse(*args: object) -> None:
        raise OSError("not a file")

    monkeypatch.setattr(abort_on_error, "os", SimpleNamespace(write=write_some, fsync=refuse))
    abort_on_error.emit("héllo\n", grace=0.0)
    assert b"".join(written) == "héllo\n".encode()
    monkeypatch.setattr(abort_on_error, "os", SimpleNamespace(write=refuse, fsync=refuse))
    abort_on_error.emit("lost\n", grace=0.5)                  # stderr is gone: still returns
    assert ends.calls[-1] == ("sleep", 0.5)


def test_messages_name_the_rank(ends: Ends, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(abort_on_error, "_who", None)      # no rank known yet
    assert abort_on_error._identify() == "[hvdlite] rank ? of ? on node7"
    monkeypatch.setattr(abort_on_error, "_who", (2, 4))
    assert abort_on_error._identify() == "[hvdlite] rank 2 of 4 on node7"


def test_an_uncaught_error_prints_its_traceback_then_aborts_with_1(
        ends: Ends, capfd: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(abort_on_error, "_who", (5, 8))       # as install() leaves it
    try:
        raise KeyError("missing")
    except KeyError as exc:
        caught = exc
    with pytest.raises(Aborted):
        abort_on_error._abort("the main thread", KeyError, caught, caught.__traceback__)
    err = capfd.readouterr().err
    assert err.startswith("[hvdlite] rank 5 of 8 on node7: uncaught KeyError in the main "
                          "thread; aborting the job (HVDLITE_ABORT_ON_ERROR=0 disables this)\n")
    assert "Traceback" in err and "KeyError: 'missing'" in err
    assert ends.calls == [("sleep", abort_on_error.ABORT_GRACE_S), ("Abort", 1), ("_exit", 1)]


@pytest.fixture
def hooks(monkeypatch: pytest.MonkeyPatch) -> list:
    """sys and threading hooks restored after the test; _abort recorded."""
    for module, name in ((sys, "excepthook"), (threading, "excepthook"), (sys, "exit")):
        monkeypatch.setattr(module, name, getattr(module, name))
    aborts: list = []
    monkeypatch.setattr(abort_on_error, "_abort", lambda *args: aborts.append(args))
    return aborts


def test_install_replaces_the_hooks_once_and_not_for_one_rank(ends: Ends, hooks: list) -> None:
    before = (sys.excepthook, threading.excepthook, sys.exit)
    abort_on_error.install(0, 1)
    assert (sys.excepthook, threading.excepthook, sys.exit) == before
    assert abort_on_error._who == (0, 1) and not abort_on_error._installed
    abort_on_error.install(1, 3)
    assert abort_on_error._who == (1, 3) and abort_on_error._installed
    assert sys.exit is abort_on_error._exit
    installed = (sys.excepthook, threading.excepthook)
    assert installed[0] is not before[0] and installed[1] is not before[1]
    abort_on_error.install(2, 3)                              # again: the same hooks
    assert (sys.excepthook, threading.excepthook) == installed and abort_on_error._who == (2, 3)


def test_every_abort_after_use_transport_ends_the_job_the_transports_way(ends: Ends,
                                                                          hooks: list) -> None:
    """Each transport ends the job its own way: the one init() hands over is used."""
    with pytest.raises(Aborted):
        abort_on_error.abort_now(2)
    ends.calls.clear()
    abort_on_error.use_transport("the transport would wait",
                                 lambda status: ends.calls.append(("transport", status)))
    abort_on_error.install(1, 3)
    with pytest.raises(Aborted):
        abort_on_error.abort_now(4)
    assert ends.calls == [("transport", 4), ("_exit", 4)]


def test_the_hooks_abort_for_errors_but_not_for_a_thread_sys_exit(ends: Ends,
                                                                  hooks: list) -> None:
    abort_on_error.install(0, 2)
    error = ValueError("boom")
    sys.excepthook(ValueError, error, None)
    thread = threading.Thread(name="loader")
    threading.excepthook(SimpleNamespace(exc_type=ValueError, exc_value=error,
                                         exc_traceback=None, thread=thread))
    threading.excepthook(SimpleNamespace(exc_type=ValueError, exc_value=error,
                                         exc_traceback=None, thread=None))
    threading.excepthook(SimpleNamespace(exc_type=SystemExit, exc_value=SystemExit(2),
                                         exc_traceback=None, thread=thread))
    assert hooks == [("the main thread", ValueError, error, None),
                     ("thread 'loader'", ValueError, error, None),
                     ("thread 'a thread'", ValueError, error, None)]


def test_a_caught_sys_exit_is_an_ordinary_system_exit_and_records_nothing(
        ends: Ends) -> None:
    with pytest.raises(SystemExit) as caught:
        abort_on_error._exit(7)
    assert caught.value.code == 7 and abort_on_error._exit_status is None
    with pytest.raises(SystemExit) as caught:
        abort_on_error._exit()
    assert caught.value.code is None


def test_exiting_with_an_error_status_aborts_with_it(ends: Ends, capfd: pytest.CaptureFixture,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(abort_on_error, "_who", (5, 8))       # as install() leaves it
    for status in (None, 0):
        monkeypatch.setattr(abort_on_error, "_exit_status", status)
        abort_on_error.abort_if_exiting_with_error()
    assert ends.calls == [] and capfd.readouterr().err == ""
    monkeypatch.setattr(abort_on_error, "_exit_status", 3)
    with pytest.raises(Aborted):
        abort_on_error.abort_if_exiting_with_error()
    assert capfd.readouterr().err.startswith(
        "[hvdlite] rank 5 of 8 on node7: exiting with status 3 (sys.exit)")
    assert ends.calls == [("sleep", abort_on_error.ABORT_GRACE_S), ("Abort", 3), ("_exit", 3)]


def test_a_lost_peer_makes_the_exit_abort_once_with_the_first_reason(
        ends: Ends, capfd: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    registered: list[Any] = []
    monkeypatch.setattr(abort_on_error, "atexit", SimpleNamespace(register=registered.append))
    abort_on_error.abort_if_broken()                          # nothing lost: nothing to do
    assert ends.calls == []
    abort_on_error.mark_broken(1, 4, "rank 3 exited")
    abort_on_error.mark_broken(2, 5, "rank 2 timed out")
    assert registered == [abort_on_error.abort_if_broken]
    assert abort_on_error._who == (1, 4)
    with pytest.raises(Aborted):
        abort_on_error.abort_if_broken()
    err = capfd.readouterr().err
    assert err.startswith("[hvdlite] rank 1 of 4 on node7: exiting after losing a peer; "
                          "aborting the job with status 1,")
    assert err.endswith("The loss: rank 3 exited\n") and "MPI_Finalize would wait" in err
    assert ends.calls == [("sleep", abort_on_error.BROKEN_EXIT_GRACE_S), ("Abort", 1), ("_exit", 1)]
    # A process ending through sys.exit(4) after the loss aborts with 4.
    ends.calls.clear()
    monkeypatch.setattr(abort_on_error, "_exit_status", 4)
    with pytest.raises(Aborted):
        abort_on_error.abort_if_broken()
    assert ends.calls[1:] == [("Abort", 4), ("_exit", 4)]


def test_under_another_transport_the_abort_names_it_not_mpi(
        ends: Ends, capfd: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(abort_on_error, "atexit", SimpleNamespace(register=lambda f: None))
    torch_transport = pytest.importorskip("hvdlite.transport.torch_transport")
    gloo = torch_transport.TorchTransport
    abort_on_error.use_transport(gloo.lost_rank_wait,
                                 lambda status: ends.calls.append(("gloo", status)))
    abort_on_error.mark_broken(1, 4, "rank 3 exited")
    with pytest.raises(Aborted):
        abort_on_error.abort_if_broken()
    err = capfd.readouterr().err
    assert "MPI" not in err and "torch.distributed (gloo) would wait for the lost rank" in err
    assert ("gloo", 1) in ends.calls          # the transport's own way to end the job


def test_a_loss_found_here_is_said_in_one_line_at_once(
        ends: Ends, capfd: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under hydra, the first output after a rank was killed ends the job: the line
    must name the lost rank, and nothing may wait before it."""
    registered: list[Any] = []
    monkeypatch.setattr(abort_on_error, "atexit", SimpleNamespace(register=registered.append))
    message = "rank 1: lost a peer: rank 3 (pid 812 on node2) exited. No collective ..."
    abort_on_error.report_loss(1, 4, message)
    assert capfd.readouterr().err == f"[hvdlite] rank 1 of 4 on node7: PeerLostError: {message}\n"
    assert [call for call in ends.calls if call != ("sleep", 0.0)] == []   # no abort yet
    assert registered == [abort_on_error.abort_if_broken] and abort_on_error._broken == message


def test_a_known_rank_is_kept_when_a_peer_is_lost(ends: Ends,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(abort_on_error, "atexit", SimpleNamespace(register=lambda f: None))
    monkeypatch.setattr(abort_on_error, "_who", (0, 2))
    abort_on_error.mark_broken(1, 4, "lost")
    assert abort_on_error._who == (0, 2)


@pytest.mark.timeout(60)
def test_install_in_a_fresh_process_replaces_the_hooks() -> None:
    code = ("import sys, threading; from hvdlite.failure import abort_on_error; "
            "hooks = (sys.excepthook, threading.excepthook); abort_on_error.install(0, 2); "
            "print(sys.exit is abort_on_error._exit, sys.excepthook is not hooks[0], "
            "threading.excepthook is not hooks[1])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=50, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert done.stdout.split() == ["True", "True", "True"], done.stderr
