"""The committed state on disk: one private file that cannot run code, replaced atomically.

Format (``state.hvd``, format 2): ``MAGIC``, the header's length (8 bytes, little
endian), the header (UTF-8 JSON: format, commit count, and per attribute its
:mod:`codec` tree and buffer lengths), the buffers' raw bytes in that order,
then the SHA-256 of everything before it. A truncated or corrupted file fails
the digest, and reading it raises :class:`StateError`; nothing in it is
executed, except a value that is neither plain data, an array nor a tensor,
pickled (a ``$pickle`` node), and that only from a file that passes the check
below.

Who can plant a state: the directory is created 0700 and the file 0600; before
loading, a directory or file owned by another user (root excepted) or writable
by group or others is refused, as ssh refuses such keys, since whoever can
write there could make every rank run their code at the next restart.
``HVDLITE_ELASTIC_TRUST_DIR=1`` turns the check off. A ``state.pkl`` of the
pickle format (hvdlite before format 2) is never loaded: it is refused, saying
how to proceed.

Atomicity: a crash at any moment leaves either the previous file or the new
one: the new state goes to a temporary file in the same directory, is
fsync'ed, then renamed over the old one (atomic within a file system), and the
directory is fsync'ed so the rename survives a power loss. A write that fails
(a full disk) removes its temporary file and raises :class:`StateWriteError`;
the previous file stands. Only rank 0 writes (``State.persist`` then raises the
error on every rank).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import pwd
import stat
import struct
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, Callable, Optional

from hvdlite.elastic.codec import Encoded
from hvdlite.errors import StateError, StateWriteError

FILE_NAME = "state.hvd"
LEGACY_FILE_NAME = "state.pkl"     # format 1: a pickle, never loaded
FORMAT = 2
MAGIC = b"hvdlite-state\n"
TRUST_VARIABLE = "HVDLITE_ELASTIC_TRUST_DIR"
_LENGTH = struct.Struct("<Q")
_DIGEST_BYTES = 32
_TEMP_PREFIX = f".{FILE_NAME}."
_log = logging.getLogger("hvdlite")


def _no_op() -> None:
    pass


# Called between the fsync of the temporary file and the rename: the tests put a
# SIGKILL here to show that a crash mid-commit leaves the last good state.
before_rename: Callable[[], None] = _no_op


def state_path(directory: str) -> Path:
    return Path(directory) / FILE_NAME


def write(directory: str, entries: dict[str, Encoded], commits: int) -> None:
    """Replace the committed state in ``directory`` with ``entries`` atomically.
    Raises StateWriteError (the previous file intact, no temporary file left) when
    the directory or the file cannot be written."""
    folder = Path(directory)
    target = state_path(directory)
    try:
        _make_private_dir(folder)
        _remove_stale_temporaries(folder)
        fd, name = tempfile.mkstemp(dir=folder, prefix=_TEMP_PREFIX, suffix=".tmp")  # 0600
    except OSError as exc:
        raise _write_error(target, exc) from exc
    temporary = Path(name)
    try:
        with os.fdopen(fd, "wb") as handle:
            _write_content(handle, entries, commits)
            handle.flush()
            os.fsync(handle.fileno())
        before_rename()
        os.replace(temporary, target)
    except Exception as exc:    # not BaseException: a simulated crash leaves it, as one would
        temporary.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise _write_error(target, exc) from exc
        raise
    _fsync_directory(folder)


def _write_error(target: Path, exc: OSError) -> StateWriteError:
    previous = ("the previous commit in it stands, unchanged" if target.exists()
                else "nothing was committed there before")
    return StateWriteError(f"rank 0 could not write the committed state {target} "
                           f"({exc.strerror or exc}); {previous}")


def _make_private_dir(folder: Path) -> None:
    """Create ``folder`` 0700 whatever the umask; an existing one is left as it is
    (never loosened; ``read`` refuses it if others can write it)."""
    if folder.is_dir():
        return
    folder.parent.mkdir(parents=True, exist_ok=True)
    try:
        folder.mkdir(mode=0o700)
    except FileExistsError:     # another process made it meanwhile: not ours to chmod
        return
    os.chmod(folder, 0o700)     # mkdir's mode is masked by the umask


def _remove_stale_temporaries(folder: Path) -> None:
    """Temporary files of writes that crashed before their rename (ours only)."""
    for leftover in folder.glob(f"{_TEMP_PREFIX}*.tmp"):
        try:
            if leftover.lstat().st_uid == os.geteuid():
                leftover.unlink()
        except OSError:
            pass


def _write_content(handle: BinaryIO, entries: dict[str, Encoded], commits: int) -> None:
    header = {"format": FORMAT, "commits": commits,
              "entries": {name: {"tree": e.tree, "buffers": [len(b) for b in e.buffers]}
                          for name, e in entries.items()}}
    text = json.dumps(header, allow_nan=False, separators=(",", ":")).encode()
    digest = hashlib.sha256()
    for piece in (MAGIC, _LENGTH.pack(len(text)), text):
        digest.update(piece)
        handle.write(piece)
    for encoded in entries.values():
        for data in encoded.buffers:
            digest.update(data)
            handle.write(data)
    handle.write(digest.digest())


def _fsync_directory(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:     # some file systems cannot open a directory: the rename is done
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read(directory: str, trust: bool = False) -> Optional[tuple[dict[str, Encoded], int]]:
    """(entries, commit count) of the committed state in ``directory``, or None when
    nothing was committed there yet. Unless ``trust``, the directory and the file
    must be private to this user (see the module doc). Raises StateError for a file
    that is not private, truncated, corrupted, or of the old pickle format."""
    folder = Path(directory)
    target = state_path(directory)
    if not folder.exists():
        return None
    if not trust:
        _check_private(folder, os.stat(folder), "directory")
    legacy = folder / LEGACY_FILE_NAME
    if not target.exists():
        if legacy.exists():
            raise StateError(
                f"rank 0 found {legacy}, a committed state of the old pickle format, which "
                f"this hvdlite never loads (unpickling a file can run any code). Delete it "
                f"to start over (rm {legacy}), or finish that run with the hvdlite that "
                "wrote it")
        return None
    if legacy.exists():
        _log.warning("ignoring %s (the old pickle format, never loaded); %s is the committed "
                     "state", legacy, target)
    try:
        fd = os.open(target, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        raise StateError(f"rank 0 cannot open the committed state {target} ({exc}); fix "
                         f"its permissions, or delete it to start over") from exc
    with os.fdopen(fd, "rb") as handle:
        if not trust:     # the file opened, not a name someone could swap meanwhile
            _check_private(target, os.fstat(handle.fileno()), "file")
        return _read_content(handle, target)


def _check_private(path: Path, info: os.stat_result, what: str) -> None:
    me = os.geteuid()
    if info.st_uid not in (me, 0):
        raise StateError(
            f"rank 0 refuses the committed state {what} {path}: it is owned by "
            f"{_user(info.st_uid)}, not by this user ({_user(me)}), mode "
            f"{_mode(info)}; whoever wrote it could make every rank run their code. Use "
            f"a directory of your own as HVDLITE_ELASTIC_DIR, or set {TRUST_VARIABLE}=1 "
            "if you trust that user")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise StateError(
            f"rank 0 refuses the committed state {what} {path}: it is group- or "
            f"world-writable (mode {_mode(info)}, owner {_user(info.st_uid)}), so others "
            f"could plant a state that runs their code on every rank. Run `chmod go-w "
            f"{path}`, or set {TRUST_VARIABLE}=1 if you trust everyone who can write it")


def _user(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid} (no such user here)"


def _mode(info: os.stat_result) -> str:
    return oct(stat.S_IMODE(info.st_mode))


def _read_content(handle: BinaryIO, target: Path) -> tuple[dict[str, Encoded], int]:
    digest = hashlib.sha256()

    def take(count: int) -> bytes:
        data = handle.read(count)
        if len(data) != count:
            raise unreadable(target, f"it ends after {handle.tell()} bytes (truncated)")
        digest.update(data)
        return data

    if take(len(MAGIC)) != MAGIC:
        raise unreadable(target, f"it does not start with {MAGIC!r}")
    size = os.fstat(handle.fileno()).st_size
    (length,) = _LENGTH.unpack(take(_LENGTH.size))
    if length > size:
        raise unreadable(target, f"its header length {length} exceeds its size {size}")
    header = _parse_header(take(length), target)
    entries = {}
    for name, entry in header["entries"].items():
        lengths = entry["buffers"]
        if any(type(n) is not int or not 0 <= n <= size for n in lengths):
            raise unreadable(target, f"attribute {name!r} has bad buffer lengths")
        entries[name] = Encoded(entry["tree"], tuple(take(n) for n in lengths))
    expected = handle.read(_DIGEST_BYTES + 1)
    if expected != digest.digest():
        raise unreadable(target, "its SHA-256 does not match its content (truncated or "
                       "changed after it was written)")
    return entries, header["commits"]


def _parse_header(text: bytes, target: Path) -> dict[str, Any]:
    try:
        header = json.loads(text)
    except ValueError as exc:
        raise unreadable(target, f"its header is not JSON ({exc})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise unreadable(target, f"its header is not of format {FORMAT}")
    entries = header.get("entries")
    if type(header.get("commits")) is not int or not isinstance(entries, dict) or any(
            not isinstance(e, dict) or not isinstance(e.get("buffers"), list)
            or "tree" not in e for e in entries.values()):
        raise unreadable(target, "its header lacks the commit count or the entries")
    return header


def unreadable(target: Path, what: str) -> StateError:
    """The error for a committed state that cannot be read back (``what`` says why)."""
    return StateError(f"rank 0 cannot read the committed state {target}: {what}. Delete it "
                      "to start over, or restore it from a copy")
