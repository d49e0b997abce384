"""Outputs checked at ``init()``, before the first step.

Rank 0 writes the report at shutdown, the timeline from ``init()`` on, the
elastic state at each commit and the autotune log while autotune runs. A path that cannot be written would otherwise be
found out only then: the report after the whole run (and lost), the timeline
as a failed ``init()`` on rank 0 alone, which leaves the other ranks waiting
for it. Looking is not enough (a dangling symbolic link passes ``stat`` of its
parent and ``access``, then every write fails), so rank 0 proves each path the
way its writer will use it: it creates the missing directories, creates, writes,
syncs and removes a probe file where the real one will go (symbolic links
followed), then removes the directories it created, so nothing is left behind.
A FIFO, socket or device is refused without being opened (opening a FIFO for
writing blocks until something reads it). Rank 0 broadcasts what it found, and
every rank raises the same :class:`OutputPathError` (or, with
``HVDLITE_OUTPUT_CHECK=warn``, rank 0 logs it).
"""
from __future__ import annotations

import logging
import os
import stat
import tempfile
from typing import Any, Optional

from hvdlite.errors import OutputPathError

_log = logging.getLogger("hvdlite")
PROBE_PREFIX = ".hvdlite-probe-"
_PROBE_TEXT = b"hvdlite checks that its outputs can be written here; this file is removed\n"


def directory_problem(path: str) -> Optional[str]:
    """Why files cannot be written in the directory ``path``, or None. It may be
    missing: its writers create it (and its parents), and so does the probe, for
    as long as the probe lasts."""
    created: list[str] = []
    try:
        problem = _make_directories(os.path.abspath(path), created)
        if problem is None and not os.path.isdir(path):
            problem = f"{path} exists and is not a directory"
        return problem if problem is not None else _probe_in(path)
    finally:
        for directory in reversed(created):
            _remove(directory, os.rmdir)


def file_problem(path: str) -> Optional[str]:
    """Why the file ``path`` could not be created (or truncated) and written, or None.
    Its directory must exist: the timeline opens the file, it creates no parents. An
    existing regular file is opened for writing, neither truncated nor written."""
    link = os.path.islink(path)
    target = os.path.realpath(path) if link else os.path.abspath(path)
    prefix = f"it is a symbolic link to {target}, and " if link else ""
    try:
        info: Optional[os.stat_result] = os.stat(target)
    except FileNotFoundError:
        info = None
    except OSError as exc:      # a loop of links, a directory that cannot be searched
        return f"{prefix}{target} cannot be looked up ({exc.strerror})"
    if info is not None:
        if stat.S_ISDIR(info.st_mode):
            return f"{prefix}{target if link else path} is a directory, not a file"
        if not stat.S_ISREG(info.st_mode):
            return (f"{prefix}{target if link else path} is {describe_kind(info.st_mode)}, "
                    "not a regular file")
        return _open_existing(target, prefix)
    parent = os.path.dirname(target)
    if os.path.islink(parent) and not os.path.exists(parent):
        return f"{prefix}{_dangling(parent)}"
    if not os.path.lexists(parent):
        return f"{prefix}its directory {parent} does not exist"
    if not os.path.isdir(parent):
        return f"{prefix}{parent} is not a directory"
    problem = _probe_at(target)
    return None if problem is None else f"{prefix}{problem}"


def _dangling(link: str) -> str:
    return f"{link} is a symbolic link to {os.path.realpath(link)}, which does not exist"


def describe_kind(mode: int) -> str:
    """'a FIFO', 'a socket', 'a device'...: what a file that is not regular is."""
    for test, kind in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISDIR, "a directory")):
        if test(mode):
            return kind
    return "not a regular file"


def _make_directories(path: str, created: list[str]) -> Optional[str]:
    """Create ``path`` and its missing parents as ``os.makedirs`` would (appending each
    to ``created``), or say why they cannot be. A dangling link is not followed: the
    writers' ``makedirs`` fails on it too."""
    missing, ancestor = [], path
    while not os.path.lexists(ancestor):
        missing.append(ancestor)
        ancestor = os.path.dirname(ancestor)
    if os.path.islink(ancestor) and not os.path.exists(ancestor):
        return _dangling(ancestor)
    if missing and not os.path.isdir(ancestor):
        kind = "a file" if os.path.isfile(ancestor) else describe_kind(os.stat(ancestor).st_mode)
        return f"{ancestor} is {kind}, so no directory can be created under it"
    for directory in reversed(missing):
        try:
            os.mkdir(directory, 0o700)
        except OSError as exc:
            return (f"it would be created in {os.path.dirname(directory)}, where "
                    f"{os.path.basename(directory)} cannot be created ({exc.strerror})")
        created.append(directory)
    return None


def _probe_in(directory: str) -> Optional[str]:
    """Create, write, sync and remove a file of a fresh name in ``directory``."""
    try:
        fd, name = tempfile.mkstemp(dir=directory, prefix=PROBE_PREFIX)
    except OSError as exc:
        return f"no file can be created in the directory {directory} ({exc.strerror})"
    return _write_then_remove(fd, name, f"a file created in {directory}")


def _probe_at(path: str) -> Optional[str]:
    """Create ``path`` itself (it must not exist), write, sync and remove it."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        return f"the file {path} cannot be created ({exc.strerror})"
    return _write_then_remove(fd, path, f"the file {path}")


def _write_then_remove(fd: int, name: str, what: str) -> Optional[str]:
    # fsync too: a full disk or quota may only show when the data is flushed (NFS).
    try:
        os.write(fd, _PROBE_TEXT)
        os.fsync(fd)
    except OSError as exc:
        return f"{what} cannot be written ({exc.strerror})"
    finally:
        os.close(fd)
        _remove(name, os.unlink)
    return None


def _open_existing(path: str, link: str) -> Optional[str]:
    # Non-blocking, in case a FIFO replaced the file since the stat; nothing written.
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError as exc:
        return f"{link}the file {path} cannot be written ({exc.strerror})"
    return None


def _remove(path: str, remove: Any) -> None:
    try:
        remove(path)
    except OSError as exc:      # the check's leftover: say so, it is harmless
        _log.warning("rank 0: could not remove %s after checking the outputs (%s)",
                     path, exc.strerror)


def open_for_writing(path: str, what: str = "the timeline") -> int:
    """``os.open`` of a regular file for writing, truncated (the timeline's file, the
    autotune log). A FIFO, socket or device raises OutputPathError instead of blocking
    or writing to it; ``what`` names the output in that error."""
    fd = -1
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NONBLOCK, 0o644)
        mode = os.fstat(fd).st_mode
    except OSError as exc:
        if fd >= 0:
            os.close(fd)
        problem = file_problem(path) or exc.strerror   # ENXIO: a FIFO nobody reads
        raise OutputPathError(f"rank 0: {what} {path} cannot be written: {problem}") from exc
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise OutputPathError(f"rank 0: {what} {path} cannot be written: {path} is "
                              f"{describe_kind(mode)}, not a regular file; name a file")
    return fd    # O_NONBLOCK does nothing on a regular file


def problems(config: Any) -> list[tuple[str, str]]:
    """(variable, sentence) for every output of ``config`` that rank 0 could not write."""
    found = []
    checks = (("HVDLITE_REPORT", config.report, directory_problem),
              ("HVDLITE_TIMELINE", config.timeline_path, file_problem),
              ("HVDLITE_ELASTIC_DIR", config.elastic_dir, directory_problem),
              # The autotune log is written only while autotune runs.
              ("HVDLITE_AUTOTUNE_LOG", config.autotune_log if config.autotune else "",
               file_problem))
    for variable, path, check in checks:
        try:
            problem = check(path) if path else None
        except OSError as exc:      # rank 0 must reach the broadcast whatever happens
            problem = f"it cannot be checked ({exc})"
        if problem:
            found.append((variable, f"{variable}={path!r} cannot be used: {problem}"))
    return found


def agree(comm: Any, config: Any) -> set[str]:
    """Collective over ``comm``: rank 0 checks, every rank learns the verdict, and
    with HVDLITE_OUTPUT_CHECK=error every rank raises OutputPathError, so no rank
    starts training (or waits for a rank that did not). With 'warn', returns the
    variables whose output cannot be written (the same set on every rank)."""
    me = comm.rank
    found = comm.bcast(problems(config) if me == 0 else None, root=0)
    if not found:
        return set()
    fix = ("point the variable at a path rank 0 can write (a directory for the report "
           "and the elastic state, a file in an existing directory for the timeline and "
           "the autotune log), or set HVDLITE_OUTPUT_CHECK=warn to start anyway")
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
    "HVDLITE_ELASTIC_DIR": "the first commit written to it will raise StateWriteError on "
                           "every rank",
    "HVDLITE_AUTOTUNE_LOG": "autotune runs without its log (the report still shows its "
                            "choice)",
}
