"""A peer's process as the other ranks see it: who it is (``identity``, exchanged at
init) and whether it still runs (``process_state``), read from /proc for peers in this
process domain. Liveness and the node's shared memory both ask."""
from __future__ import annotations

import dataclasses
import os
import socket
from typing import Optional

EXITED, STOPPED, RUNNING, UNKNOWN = "exited", "stopped", "running", "unknown"


@dataclasses.dataclass(frozen=True)
class Peer:
    """What every rank tells the others about its process at init."""
    rank: int
    host: str
    pid: int
    start: Optional[int]                  # /proc start time in clock ticks (pid reuse check)
    domain: Optional[tuple[str, ...]]     # equal domains see each other's pids; None: unknown


def _read(path: str) -> Optional[str]:
    try:
        with open(path, encoding="ascii", errors="replace") as handle:
            return handle.read()
    except OSError:
        return None


def _stat_fields(text: str) -> list[str]:
    """Fields of /proc/PID/stat from the state on; the command name before them may
    itself contain spaces and parentheses, so split after its last ')'."""
    return text[text.rindex(")") + 2:].split()


def identity(rank: int, proc: str = "/proc") -> Peer:
    """This process, as its peers will see it."""
    host = socket.gethostname()
    stat = _read(f"{proc}/self/stat")
    boot = _read(f"{proc}/sys/kernel/random/boot_id")
    try:
        pid_ns = os.readlink(f"{proc}/self/ns/pid")
    except OSError:
        pid_ns = None
    start = int(_stat_fields(stat)[19]) if stat else None
    # Containers may share a host name but not a PID namespace: compare pids only
    # between processes that share host, boot and namespace.
    domain = (host, boot.strip(), pid_ns) if stat and boot and pid_ns else None
    return Peer(rank, host, os.getpid(), start, domain)


def _signal_probe(pid: int) -> str:
    """Where /proc cannot tell: signal 0 checks existence without touching the process."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return EXITED
    except OSError:      # it exists but belongs to someone else: not ours to judge
        return UNKNOWN
    return UNKNOWN


def process_state(peer: Peer, proc: str = "/proc") -> str:
    """EXITED, STOPPED, RUNNING or UNKNOWN for a process in this process domain."""
    text = _read(f"{proc}/{peer.pid}/stat")
    if text is None:
        return _signal_probe(peer.pid)
    fields = _stat_fields(text)
    if peer.start is not None and int(fields[19]) != peer.start:
        return EXITED   # the pid was reused by a newer process
    state = fields[0]
    if state in ("Z", "X"):
        return EXITED   # a zombie: ended, not yet reaped by the launcher
    return STOPPED if state in ("T", "t") else RUNNING
