"""How many commits reached the disk: counted here, told at the end of the job
(rank 0 prints one line at shutdown when HVDLITE_ELASTIC_DIR is set) and in the
HVDLITE_REPORT report, so a job never ends quietly with less on disk than it
committed.

Every rank counts the same: a write is rank 0's, but every rank learns whether
it reached the disk (``State.persist`` agrees on it), so the counts agree.
Counts cover this process, every State and every ``init()`` in it.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

from hvdlite.api import runtime
from hvdlite.diagnostics.report_summary import elastic_line


@dataclasses.dataclass
class Ledger:
    commits: int = 0                # commit() calls
    written: int = 0                # commits written to HVDLITE_ELASTIC_DIR
    failed: int = 0                 # writes that failed (each raised StateWriteError)
    on_disk: Optional[int] = None   # the commit number the file holds (None: nothing)


LEDGER = Ledger()


def snapshot(config: Any) -> Optional[dict[str, Any]]:
    """The counts, with the directory and persist interval of ``config``; None when
    no HVDLITE_ELASTIC_DIR is set (nothing was asked to reach a disk)."""
    if config is None or not config.elastic_dir:
        return None
    return {"directory": config.elastic_dir, "persist_every": config.elastic_persist_every,
            **dataclasses.asdict(LEDGER)}


def _at_shutdown() -> None:
    """The end-of-job line, on rank 0 (the writer)."""
    current = runtime.RUNTIME
    config = current.engine.config if current.engine is not None else current.config
    counts = snapshot(config)
    if counts is not None and current.topology is not None and current.topology.rank == 0:
        print(f"[hvdlite] {elastic_line(counts)}", flush=True)


def _report_record() -> Optional[dict[str, Any]]:
    return snapshot(runtime.engine().config)


runtime.STOP_HOOKS.append(_at_shutdown)
runtime.REPORT_RECORDS["elastic"] = _report_record
