"""No MPI launcher: process checks on a fake /proc, the verdict logic, the messages, the
exit guard's lifetime, and how failure.py records a sys.exit status."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hvdlite.failure import exit_guard, liveness
from hvdlite.failure.liveness import EXITED, RUNNING, STOPPED, UNKNOWN, Monitor, Peer
from hvdlite.transport import peers
from tests.unit.test_exit_guard import rank_that_ended

ROOT = Path(__file__).resolve().parents[2]
DOMAIN = ("vm", "boot-1", "pid:[4026531836]")
TICK = 0.1                                   # MPI's idle tick
OVERDUE = liveness.OVERDUE_TICKS * TICK


def _ended_pid() -> int:
    """A pid that existed and has ended (and is reaped)."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def _fake_proc(tmp_path: Path, pid: int, state: str, start: int,
               comm: str = "python") -> str:
    (tmp_path / str(pid)).mkdir(parents=True, exist_ok=True)
    fields = [state, "1", "1", "1"] + ["0"] * 15 + [str(start), "0"]
    (tmp_path / str(pid) / "stat").write_text(f"{pid} ({comm}) " + " ".join(fields) + "\n")
    return str(tmp_path)


@pytest.mark.parametrize("state, expected", [("S", RUNNING), ("R", RUNNING), ("D", RUNNING),
                                             ("T", STOPPED), ("t", STOPPED),
                                             ("Z", EXITED), ("X", EXITED)])
def test_process_state_from_proc_stat(tmp_path: Path, state: str, expected: str) -> None:
    proc = _fake_proc(tmp_path, 4242, state, 777, comm="odd) name (x")   # parsed after last ')'
    assert peers.process_state(Peer(1, "vm", 4242, 777, DOMAIN), proc) == expected


def test_a_reused_pid_counts_as_exited(tmp_path: Path) -> None:
    proc = _fake_proc(tmp_path, 4242, "S", 999)
    assert peers.process_state(Peer(1, "vm", 4242, 777, DOMAIN), proc) == EXITED


def test_a_missing_process_has_exited(tmp_path: Path) -> None:
    assert peers.process_state(Peer(1, "vm", _ended_pid(), 777, DOMAIN),
                               str(tmp_path)) == EXITED


def test_identity_of_this_process_matches_its_own_check() -> None:
    me = peers.identity(0)
    assert me.pid == os.getpid() and me.host == socket.gethostname()
    if Path("/proc/self/stat").exists():
        assert me.domain is not None and me.start is not None
        assert peers.process_state(me) == RUNNING


def _peers(n: int, remote: tuple[int, ...] = ()) -> list[Peer]:
    return [Peer(r, "vm" if r not in remote else "far", 1000 + r, 5,
                 DOMAIN if r not in remote else ("far", "boot-2", "pid:[1]"))
            for r in range(n)]


class _Probe:
    def __init__(self, states: dict[int, str]) -> None:
        self.states = states
        self.probed: list[int] = []

    def __call__(self, peer: Peer) -> str:
        self.probed.append(peer.rank)
        return self.states.get(peer.rank, RUNNING)


def test_nothing_is_checked_before_a_round_is_overdue() -> None:
    probe = _Probe({1: EXITED})
    monitor = Monitor(0, _peers(2), timeout=5, probe=probe, idle_tick_s=TICK)
    assert not monitor.overdue(100.0, 100.0 + OVERDUE / 2)
    assert probe.probed == []


@pytest.mark.parametrize("idle_tick_s, overdue_s", [(0.1, 0.5), (0.4, 2.0)])
def test_a_round_is_overdue_after_five_of_its_transports_idle_ticks(
        idle_tick_s: float, overdue_s: float) -> None:
    """An idle engine over Gloo joins a round every 0.4 s: a peer waiting that long on
    it is no sign of trouble, and pinging then would cost every step."""
    monitor = Monitor(0, _peers(2), timeout=5, probe=_Probe({}), idle_tick_s=idle_tick_s)
    assert not monitor.overdue(100.0, 100.0 + overdue_s * 0.99)
    assert monitor.overdue(100.0, 100.0 + overdue_s)


def test_an_exited_local_peer_is_lost_as_soon_as_the_round_is_overdue() -> None:
    probe = _Probe({2: EXITED})
    monitor = Monitor(0, _peers(3), timeout=20, probe=probe, idle_tick_s=TICK)
    now = 100.0 + OVERDUE
    assert monitor.overdue(100.0, now)
    losses = monitor.assess(now)
    assert [(loss.peer.rank, loss.how) for loss in losses] == [(2, EXITED)]
    assert monitor.survivors(losses) == [1]


def test_a_silent_peer_is_lost_only_after_the_timeout_and_heard_peers_never() -> None:
    probe = _Probe({2: STOPPED})
    monitor = Monitor(0, _peers(3), timeout=5, probe=probe, idle_tick_s=TICK)
    start = 100.0
    for now in (start + 1, start + 3, start + 4.9):
        assert monitor.overdue(start, now)
        monitor.heard(1, now)
        assert monitor.assess(now) == []
    now = start + 5.2
    losses = monitor.assess(now)
    assert [(loss.peer.rank, loss.how) for loss in losses] == [(2, STOPPED)]
    assert losses[0].silent_for == pytest.approx(5.2)


def test_remote_peers_are_never_probed_and_only_time_out() -> None:
    probe = _Probe({})
    monitor = Monitor(0, _peers(3, remote=(2,)), timeout=5, probe=probe, idle_tick_s=TICK)
    monitor.overdue(100.0, 101.0)
    monitor.heard(1, 104.0)
    assert monitor.assess(101.0) == [] and probe.probed == [1]
    losses = monitor.assess(105.5)
    assert [(loss.peer.rank, loss.how) for loss in losses] == [(2, UNKNOWN)]


def test_timeout_zero_reports_exits_only() -> None:
    monitor = Monitor(0, _peers(3), timeout=0, probe=_Probe({1: EXITED}), idle_tick_s=TICK)
    monitor.overdue(100.0, 101.0)
    assert [loss.peer.rank for loss in monitor.assess(1000.0)] == [1]


def test_a_new_wait_forgets_the_previous_one() -> None:
    monitor = Monitor(0, _peers(2), timeout=5, probe=_Probe({}), idle_tick_s=TICK)
    monitor.overdue(100.0, 101.0)
    monitor.heard(1, 101.0)
    monitor.overdue(200.0, 201.0)        # a later round: silence counts from its start
    assert monitor.assess(204.0) == []
    assert [loss.peer.rank for loss in monitor.assess(205.5)] == [1]


def test_pings_are_rate_limited() -> None:
    monitor = Monitor(0, _peers(2), timeout=4, probe=_Probe({}), idle_tick_s=TICK)
    monitor.overdue(100.0, 101.0)
    interval = liveness.ping_interval(4)
    assert monitor.ping_due(101.0) and not monitor.ping_due(101.0 + interval / 2)
    assert monitor.ping_due(101.0 + interval)
    assert liveness.MIN_PING_S <= liveness.ping_interval(1) <= liveness.ping_interval(1000) \
        == liveness.MAX_PING_S


def test_messages_name_the_rank_and_what_happened() -> None:
    peers = _peers(4)
    what = liveness.describe([liveness.Loss(peers[3], STOPPED, 6.04),
                              liveness.Loss(peers[1], EXITED, 0.7)])
    assert what.startswith("rank 1 (pid 1001 on vm) exited; rank 3 (pid 1003 on vm) "
                           "stopped answering for 6.0 s (its process is stopped")
    message = liveness.error_message(0, what, reporter=2, timeout=20)
    assert message.startswith("rank 0: lost a peer: rank 1 (pid 1001 on vm) exited;")
    assert "(detected by rank 2)" in message and "HVDLITE_PEER_TIMEOUT=20 s" in message


def test_exit_guard_is_for_hydra_only() -> None:
    read, write = os.pipe()
    try:
        assert exit_guard.hydra_pmi_fd({"PMI_FD": str(read), "MPI_LOCALNRANKS": "2"}) == read
        assert exit_guard.hydra_pmi_fd({"PMI_FD": str(read)}) is None        # srun's PMI2
        assert exit_guard.hydra_pmi_fd({"PMI_PORT": "h:1", "MPI_LOCALNRANKS": "2"}) is None
    finally:
        os.close(read)
        os.close(write)


def test_exit_guard_holds_the_socket_for_the_grace_period_after_the_rank_ends() -> None:
    with rank_that_ended(1.5) as (launcher, guard, killed):
        launcher.settimeout(30)
        assert launcher.recv(1) == b""         # EOF only once the guard let go
        assert 1.5 <= time.monotonic() - killed < 8    # not 1.5 + MARGIN_S (10 s)
        assert guard.wait(timeout=30) == 0


_EXIT_PROBE = """
import atexit, sys
from hvdlite.failure import abort_on_error
abort_on_error._installed = True
sys.exit = abort_on_error._exit
atexit.register(lambda: print("recorded", abort_on_error._exit_status, flush=True))
try:
    sys.exit(4)
except SystemExit as caught:
    assert caught.code == 4        # read by code: not an exit
print("recorded", abort_on_error._exit_status, flush=True)
sys.exit({final!r})
"""


@pytest.mark.parametrize("final, status", [(3, 3), ("message", 1), (None, 0)])
def test_only_the_sys_exit_that_ends_the_program_is_recorded(final: object,
                                                             status: int) -> None:
    proc = subprocess.run([sys.executable, "-c", _EXIT_PROBE.format(final=final)], cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == status, proc.stderr
    assert proc.stdout.split("\n")[:2] == ["recorded None", f"recorded {status}"], proc.stdout
