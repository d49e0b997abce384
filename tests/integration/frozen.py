"""Runs jobs.frozen_in_collective under a launcher (mpiexec, torchrun) and checks what the
survivors of its stopped rank say; for test_liveness.py and test_torchrun.py."""
from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import time
from pathlib import Path
from typing import Sequence

from tests.processes import alive

ROOT = Path(__file__).resolve().parents[2]
PEER_TIMEOUT_S = 5
# The promise under test: the survivors fail within the peer timeout plus a few
# seconds; ten for a loaded two-core machine.
MARGIN_S = 10
# A hard limit on the whole job (start-up, the timeout, the end): a survivor that hangs
# fails the test instead of stalling CI.
JOB_LIMIT_S = 150


def _kill(pid: int) -> None:
    """SIGKILL, then SIGCONT: a stopped process never handles its launcher's SIGTERM."""
    for sig in (signal.SIGKILL, signal.SIGCONT):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def run_frozen(command: Sequence[str], np: int, victim: int, env: dict[str, str],
               op: str = "allreduce") -> str:
    """The job's output (``op``: jobs.frozen_in_collective's FROZEN_OP). Read until
    every survivor has reported its PeerLostError (or JOB_LIMIT_S passed); then the
    stopped rank is killed, and the launcher must end."""
    env = dict(env, PYTHONPATH=str(ROOT), HVDLITE_PEER_TIMEOUT=str(PEER_TIMEOUT_S),
               FROZEN_RANK=str(victim), FROZEN_OP=op)
    proc = subprocess.Popen(list(command), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    assert proc.stdout is not None
    output, deadline = b"", time.monotonic() + JOB_LIMIT_S
    pids: dict[int, int] = {}
    try:
        while time.monotonic() < deadline and output.count(b"PEER_LOST rank") < np - 1:
            if select.select([proc.stdout], [], [], 0.2)[0]:
                chunk = os.read(proc.stdout.fileno(), 65536)
                if not chunk:
                    break
                output += chunk
        pids = {int(r): int(p) for r, p in re.findall(rb"PIDS rank (\d+): (\d+)", output)}
    finally:
        if victim in pids:
            _kill(pids[victim])
        try:
            rest, _ = proc.communicate(timeout=max(deadline - time.monotonic(), 30))
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)     # the launcher then ends its ranks
            try:
                rest, _ = proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                rest, _ = proc.communicate()
            for pid in pids.values():
                _kill(pid)
            raise AssertionError(f"the job still ran {JOB_LIMIT_S} s after its start:\n"
                                 + (output + rest).decode(errors="replace"))
    text = (output + rest).decode(errors="replace")
    assert proc.returncode != 0, text
    return text


def check_survivors(output: str, np: int, victim: int) -> list[float]:
    """Every other rank failed with PeerLostError naming the stopped rank, within the
    promise; nothing of the job is left. Returns the survivors' seconds."""
    pids = {int(r): int(p) for r, p in re.findall(r"PIDS rank (\d+): (\d+)", output)}
    assert sorted(pids) == list(range(np)), output
    reports = {int(r): (float(t), m) for r, t, m in
               re.findall(r"PEER_LOST rank (\d+) after ([\d.]+) s: (.*)", output)}
    assert sorted(reports) == [r for r in range(np) if r != victim], output
    for seconds, message in reports.values():
        # Each survivor's failing call began before the stop; the verdict comes once the
        # rank was silent for the timeout.
        assert PEER_TIMEOUT_S - 1 <= seconds < PEER_TIMEOUT_S + MARGIN_S, output
        assert f"rank {victim} (pid {pids[victim]} on " in message, message
        assert "stopped answering for" in message and "SIGSTOP" in message, message
    assert "NO_ERROR" not in output, output
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(alive(p) for p in pids.values()):
        time.sleep(0.1)
    assert not [p for p in pids.values() if alive(p)], output
    return [seconds for seconds, _ in reports.values()]
