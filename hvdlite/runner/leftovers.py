"""Files an MPI job leaves behind when it does not end through MPI_Finalize, and their
sweep: by hvdliterun on its own node after a job that failed (runner/supervise.py), and by
each pytest session for the jobs it started (tests/conftest.py).

A job ended by MPI_Abort (how hvdlite ends a job one of whose ranks failed) or a killed
rank leaves:

- MPICH's hydra topology file, /tmp/hydra_hwloc_xmlfile_XXXXXX (the path is built in:
  TMPDIR does not move it);
- the node's shared-memory segment, which MPI_Finalize would have removed: MPICH's
  /dev/shm/mpich_shm_* (2 MiB) after a killed rank or MPI_Abort; Open MPI's
  /dev/shm/sm_segment.* (16 MiB) when mpirun itself was killed (a test's time limit).

hvdlite's own shared memory under torchrun (transport/node_memory.py) has no name, so it
leaves nothing to sweep.

And a launcher killed itself (SIGKILL) leaves the folder it keeps while it runs: Open
MPI's prterun, TMPDIR/ompi.PID (its PMIx rendezvous files and hwloc's shared topology).

The test suite's crash tests end about a hundred jobs that way a run: this machine's
/dev/shm held 1,184 such segments, 2.3 GB, after a day of test runs. Where /dev/shm is
small (a container's default is 64 MiB), a few dozen failed jobs fill it, and then every
MPI job fails at MPI_Init.

A segment still mapped by a live process belongs to a running job (another of this
user's, a benchmark's) and is kept. A hydra topology file is mapped by nobody: its job's
proxy wrote it and hands its path to the ranks as they start, so while any hydra proxy
lives, every such file is kept (a later sweep removes it). Another user's files are not
ours to remove (the sticky /dev/shm refuses it, and the error is ignored).
"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Mapping, Optional, Sequence

PLACES: Mapping[Path, Sequence[str]] = {
    Path("/tmp"): ("hydra_hwloc_xmlfile_*",),
    Path("/dev/shm"): ("mpich_shm_*", "sm_segment.*", "vader_segment.*"),
}
# Files that a live process of the named program may still be about to hand out.
KEPT_WHILE_RUNNING: Mapping[str, str] = {"hydra_hwloc_xmlfile_*": "hydra_pmi_proxy"}


def present(places: Mapping[Path, Sequence[str]] = PLACES) -> set[Path]:
    """The files matching ``places`` now."""
    return {path for where, patterns in places.items() for pattern in patterns
            for path in where.glob(pattern)}


def mapped(proc: Path = Path("/proc")) -> set[str]:
    """The paths of files any live process maps (the maps this user may read)."""
    paths: set[str] = set()
    for maps in proc.glob("[0-9]*/maps"):
        try:
            text = maps.read_text(errors="replace")
        except OSError:          # the process ended, or is another user's
            continue
        for line in text.splitlines():
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith("/"):
                paths.add(fields[5].removesuffix(" (deleted)"))
    return paths


def programs(proc: Path = Path("/proc")) -> set[str]:
    """The names (comm) of the live processes this user may see."""
    names: set[str] = set()
    for comm in proc.glob("[0-9]*/comm"):
        try:
            names.add(comm.read_text(errors="replace").strip())
        except OSError:          # the process ended
            continue
    return names


def sweep(before: set[Path], places: Mapping[Path, Sequence[str]] = PLACES,
          proc: Path = Path("/proc")) -> list[Path]:
    """Remove the files that appeared since ``before`` and that no live process maps;
    the removed ones, sorted."""
    new = present(places) - before
    if not new:
        return []
    in_use = mapped(proc)
    running = programs(proc)
    kept = [pattern for pattern, program in KEPT_WHILE_RUNNING.items() if program in running]
    gone = sorted(path for path in new if str(path) not in in_use
                  and not any(path.match(pattern) for pattern in kept))
    removed = []
    for path in gone:
        try:
            path.unlink(missing_ok=True)
            removed.append(path)
        except OSError:          # another user's, in the sticky /tmp or /dev/shm
            pass
    return removed


def launcher_folders(launcher: int, tmpdir: Optional[str] = None) -> list[Path]:
    """The folders that the launcher process ``launcher`` kept in ``tmpdir`` (TMPDIR) and
    left there; remove them only once it is gone."""
    folder = Path(tmpdir or tempfile.gettempdir()) / f"ompi.{launcher}"
    return [folder] if folder.is_dir() else []


def remove_launcher_folders(launcher: int) -> list[Path]:
    """Remove what launcher_folders finds for ``launcher``, which has ended; those removed."""
    found = launcher_folders(launcher)
    for folder in found:
        shutil.rmtree(folder, ignore_errors=True)
    return found
