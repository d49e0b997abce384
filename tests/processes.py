"""Process checks shared by tests that start and stop processes of their own."""
from __future__ import annotations

from pathlib import Path


def alive(pid: int) -> bool:
    """Running, and not a zombie (an orphan's zombie lingers where init does not reap)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] not in "ZX"
