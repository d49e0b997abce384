"""Process checks shared by tests that start and stop processes of their own."""
from __future__ import annotations

import random
import socket
from pathlib import Path


def alive(pid: int) -> bool:
    """Running, and not a zombie (an orphan's zombie lingers where init does not reap)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] not in "ZX"


def free_port() -> int:
    """A port free now, below Linux's ephemeral range (32768 up), from which every
    outgoing connection on the machine (other tests' too) takes its local port: a port
    picked there can be taken by one before the test's server binds it."""
    while True:
        port = random.randrange(20000, 32000)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
