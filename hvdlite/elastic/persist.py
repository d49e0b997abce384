"""The committed state on disk: one file, replaced atomically.

A crash at any moment leaves either the previous file or the new one, never a
torn mix: the new state goes to a temporary file in the same directory, is
fsync'ed, then renamed over the old one (rename is atomic within a file
system), and the directory is fsync'ed so the rename itself survives a power
loss. Only rank 0 writes; the others receive the state through ``sync()``.
"""
from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Callable, Optional

from hvdlite.errors import StateError

FILE_NAME = "state.pkl"
FORMAT = 1


def _no_op() -> None:
    pass


# Called between the fsync of the temporary file and the rename: the tests put a
# SIGKILL here to show that a crash mid-commit leaves the last good state.
before_rename: Callable[[], None] = _no_op


def state_path(directory: str) -> Path:
    return Path(directory) / FILE_NAME


def write(directory: str, entries: dict[str, bytes], commits: int) -> None:
    """Replace the committed state in ``directory`` with ``entries`` (pickled values
    by attribute name) atomically."""
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    target = state_path(directory)
    temporary = folder / f".{FILE_NAME}.{os.getpid()}.tmp"
    payload = pickle.dumps({"format": FORMAT, "commits": commits, "entries": entries},
                           protocol=pickle.HIGHEST_PROTOCOL)
    with open(temporary, "wb") as handle:
        handle.write(payload)
        handle.flush()
        os.fsync(handle.fileno())
    before_rename()
    os.replace(temporary, target)
    _fsync_directory(folder)


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


def read(directory: str) -> Optional[tuple[dict[str, bytes], int]]:
    """(entries, commit count) of the committed state in ``directory``, or None when
    nothing was committed there yet. Temporary files of an interrupted write are
    ignored (and left for the next write to replace)."""
    target = state_path(directory)
    if not target.exists():
        return None
    try:
        with open(target, "rb") as handle:
            content = pickle.load(handle)
    except Exception as exc:
        raise StateError(f"the committed state {target} cannot be read ({exc}); delete it "
                         "to start over") from exc
    if not isinstance(content, dict) or content.get("format") != FORMAT:
        raise StateError(f"{target} is not an hvdlite elastic state (format {FORMAT}); "
                         "delete it to start over")
    return content["entries"], int(content["commits"])
