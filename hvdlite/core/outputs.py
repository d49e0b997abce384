"""Outputs checked at ``init()``, before the first step.

Rank 0 writes the report at shutdown, the timeline from ``init()`` on and the
elastic state at each commit. A path that cannot be written would otherwise be
found out only then: the report after the whole run (and lost), the timeline
as a failed ``init()`` on rank 0 alone, which leaves the other ranks waiting
for it. Here rank 0 looks at every output path without creating anything
(``stat`` and ``access`` only, so nothing is left behind when nothing is
written), broadcasts what it found, and every rank raises the same
:class:`OutputPathError` (or, with ``HVDLITE_OUTPUT_CHECK=warn``, rank 0 logs it).
"""
from __future__ import annotations

import logging
import os
from typing import Any, Optional

from hvdlite.errors import OutputPathError

_log = logging.getLogger("hvdlite")


def directory_problem(path: str) -> Optional[str]:
    """Why the directory ``path`` could not be created or written into, or None.
    It may be missing: its writers create it (and its parents) when they write."""
    if os.path.exists(path):
        if not os.path.isdir(path):
            return f"{path} exists and is not a directory"
        return None if _writable(path) else f"the directory {path} cannot be written"
    return _creatable(path)


def file_problem(path: str) -> Optional[str]:
    """Why the file ``path`` could not be created (or truncated), or None. Its
    directory must exist: the timeline opens the file, it creates no parents."""
    if os.path.isdir(path):
        return f"{path} is a directory, not a file"
    if os.path.exists(path):
        return None if os.access(path, os.W_OK) else f"the file {path} cannot be written"
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.exists(parent):
        return f"its directory {parent} does not exist"
    if not os.path.isdir(parent):
        return f"{parent} is not a directory"
    return None if _writable(parent) else f"the directory {parent} cannot be written"


def _creatable(path: str) -> Optional[str]:
    """``os.makedirs(path)`` would succeed: the nearest existing ancestor is a
    directory this process may create entries in."""
    ancestor = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        return f"{ancestor} is a file, so no directory can be created under it"
    if not _writable(ancestor):
        return f"it would be created in {ancestor}, which cannot be written"
    return None


def _writable(directory: str) -> bool:
    # access() answers for this process's credentials, root included, and says no
    # on a read-only mount (EROFS), where root's permission bits would say yes.
    return os.access(directory, os.W_OK | os.X_OK)


def problems(config: Any) -> list[tuple[str, str]]:
    """(variable, sentence) for every output of ``config`` that rank 0 could not write."""
    found = []
    checks = (("HVDLITE_REPORT", config.report, directory_problem),
              ("HVDLITE_TIMELINE", config.timeline_path, file_problem),
              ("HVDLITE_ELASTIC_DIR", config.elastic_dir, directory_problem))
    for variable, path, check in checks:
        problem = check(path) if path else None
        if problem:
            found.append((variable, f"{variable}={path!r} cannot be used: {problem}"))
    return found


def agree(comm: Any, config: Any) -> set[str]:
    """Collective over ``comm``: rank 0 checks, every rank learns the verdict, and
    with HVDLITE_OUTPUT_CHECK=error every rank raises OutputPathError, so no rank
    starts training (or waits for a rank that did not). With 'warn', returns the
    variables whose output cannot be written (the same set on every rank)."""
    me = comm.Get_rank()
    found = comm.bcast(problems(config) if me == 0 else None, root=0)
    if not found:
        return set()
    fix = ("point the variable at a path rank 0 can write (a directory for the report "
           "and the elastic state, a file in an existing directory for the timeline), or "
           "set HVDLITE_OUTPUT_CHECK=warn to start anyway")
    if config.output_check == "warn":
        if me == 0:
            for variable, problem in found:
                _log.warning("rank 0: %s; %s", problem, _WARN_CONSEQUENCE[variable])
        return {variable for variable, _ in found}
    where = "" if me == 0 else " (rank 0 writes the outputs and found this)"
    text = "; ".join(problem for _, problem in found)
    raise OutputPathError(f"rank {me}: hvdlite.init(){where}: {text}. Fix: {fix}")


# HVDLITE_OUTPUT_CHECK=warn: what becomes of each output. The timeline is skipped: it
# is opened inside init(), where a failure on rank 0 alone would strand the others.
_WARN_CONSEQUENCE = {
    "HVDLITE_REPORT": "the report will fail to be written at shutdown",
    "HVDLITE_TIMELINE": "no timeline is written",
    "HVDLITE_ELASTIC_DIR": "commits will fail when they are written to it",
}
