"""Keep a rank's launcher connection open for a while after the rank's process ends.

MPICH's hydra proxy watches each rank's PMI socket (``PMI_FD``). When a rank's
process ends without MPI_Finalize (``os._exit``, a kill), the socket closes and
hydra SIGKILLs every other rank on that host at once, recording exit status 0
for them: the job "succeeds" with no message, and the survivors never get the
chance to report the loss. (When hydra happens to reap the process before it
sees the socket close, it kills nobody and the survivors hang instead.)

The guard is a tiny helper process that inherits the rank's PMI socket and
holds it until either the launcher closes its end (MPI_Finalize completed, or
the launcher is gone: the normal case, where the guard exits at once), or the
rank's process has been gone for ``grace`` seconds. During that grace period
the surviving ranks detect the loss (hvdlite.failure.liveness), raise
PeerLostError and abort the job with a non-zero status.

It also holds copies of the rank's stdout and stderr after the rank's end, until
the other ranks on its host have ended too, or for ``hold`` seconds. Hydra looks
for ended ranks (waitpid) whenever something happens on its sockets, and a rank
killed by a signal makes it kill every other rank at once. When the killed
rank's output closed, that look came either right after its death, so the
survivors were killed within milliseconds, before they could say which rank was
lost, or just too early (the process was not a zombie yet), and then nothing
happened until the guard let go of the PMI socket: 30 s later (issue 34). With
the output held, the first thing hydra sees is a survivor's report of the loss
(abort_on_error.report_loss); hydra then ends the other ranks, and the guard lets go of
the output, the last thing hydra waits for. ``hold`` bounds the wait where no
survivor reports. (Output the rank wrote in its last milliseconds, read by hydra
after its death, is such an event too: that race remains.)

This file must run as a script under ``python -I -S`` (no hvdlite import, no
site packages), so it imports only the standard library.
"""
from __future__ import annotations

import logging
import os
import select
import subprocess
import sys
import time
from typing import Mapping, Optional, Sequence

_PARENT_POLL_S = 0.5   # fallback parent check where pidfd_open is unavailable (pre-5.3 kernels)
# The guard holds a lost rank's connection this much longer than the peer timeout:
# time for the survivors to reach their verdict (at most the timeout) and abort.
MARGIN_S = 10.0
# At most this long after the rank's end its output is held: survivors on its host
# report the loss within about a second (a pidfd wakes them, hvdlite.failure.sentinel);
# the rest is margin for a loaded host, inside the promise of an end within 10 s.
HOLD_S = 5.0
# While the output is held, how often the guard looks whether the other ranks ended.
_SIBLING_POLL_S = 0.05
_spawned: Optional[subprocess.Popen] = None   # one guard per process, kept referenced


def hydra_pmi_fd(environ: Mapping[str, str]) -> Optional[int]:
    """The PMI socket of a rank started by hydra, or None. Hydra sets PMI_FD together
    with MPI_LOCALNRANKS; srun's PMI2 also sets PMI_FD, but slurmstepd does not kill
    the other tasks when one closes it, so no guard is needed there."""
    if "MPI_LOCALNRANKS" not in environ:
        return None
    try:
        fd = int(environ["PMI_FD"])
        os.fstat(fd)
    except (KeyError, ValueError, OSError):
        return None   # PMI_PORT mode (hydra -pmi_port) or an fd already closed
    return fd


def spawn(environ: Mapping[str, str], peer_timeout: float) -> Optional[subprocess.Popen]:
    """Start this process's guard once; None where there is nothing to guard."""
    global _spawned
    fd = hydra_pmi_fd(environ)
    if _spawned is not None or fd is None:
        return _spawned
    # Same process group as the rank: hydra kills ranks by process group, so an abort
    # takes the guard with it. Its own stdio is /dev/null; the rank's output copies
    # are held under other numbers, closed when the rank's end has been reported.
    grace = peer_timeout + MARGIN_S
    held = _output_copies()
    try:
        _spawned = subprocess.Popen(
            [sys.executable, "-I", "-S", os.path.abspath(__file__), str(os.getpid()),
             str(fd), repr(float(grace)), repr(HOLD_S), str(os.getppid()), *map(str, held)],
            pass_fds=(fd, *held), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, close_fds=True)
    except OSError as exc:   # without it, a silent exit may go unreported, as before
        logging.getLogger("hvdlite").warning(
            "could not start the exit guard (HVDLITE_EXIT_GUARD=0 skips it): %s", exc)
    finally:
        for copy in held:
            os.close(copy)
    return _spawned


def _output_copies() -> list[int]:
    """Copies of this process's stdout and stderr (those open), for the guard to hold.
    Its own fds 1 and 2 stay /dev/null: it never writes to the rank's output."""
    copies = []
    for std in (1, 2):
        try:
            copies.append(os.dup(std))
        except OSError:
            pass
    return copies


def _wait_for_parent(parent: int, watch: "select.poll", fd: int) -> bool:
    """Block until the parent ends (True) or the launcher closes the socket (False)."""
    try:
        pidfd = os.pidfd_open(parent)
    except (AttributeError, OSError):   # old kernel, or the parent is already gone
        pidfd = None
    if pidfd is not None:
        watch.register(pidfd, select.POLLIN)
    while True:
        timeout = None if pidfd is not None else _PARENT_POLL_S * 1000
        for ready, _ in watch.poll(timeout):
            if ready == fd:
                return False
            if ready == pidfd:
                watch.unregister(pidfd)
                os.close(pidfd)
                return True
        if pidfd is None and os.getppid() != parent:
            return True


def main(argv: Sequence[str]) -> int:
    parent, fd, grace, hold = int(argv[0]), int(argv[1]), float(argv[2]), float(argv[3])
    launcher, held = int(argv[4]), [int(copy) for copy in argv[5:]]
    watch = select.poll()
    # Only "peer closed" (POLLRDHUP, plus the implied POLLHUP/POLLERR), never POLLIN:
    # the PMI replies on this socket belong to the rank, and the guard reads nothing.
    watch.register(fd, select.POLLRDHUP)
    if not _wait_for_parent(parent, watch, fd):
        return 0
    ended = time.monotonic()
    others = _siblings(launcher, parent)
    deadline = ended + grace
    while (left := deadline - time.monotonic()) > 0:
        if watch.poll(min(left, _SIBLING_POLL_S if held else left) * 1000):
            break                                   # the launcher is done with the rank
        if held and (time.monotonic() >= ended + hold
                     or (others and not any(map(_running, others)))):
            for copy in held:
                os.close(copy)
            held = []
    return 0


def _siblings(launcher: int, rank: int) -> list[int]:
    """The other ranks that hydra's proxy (``launcher``) started on this host: its
    other children. None where the rank's parent is not the proxy (a wrapper
    script): the output is then held for the whole ``hold``."""
    found = []
    for name in os.listdir("/proc") if launcher > 1 and os.path.isdir("/proc") else ():
        if not name.isdigit() or int(name) in (rank, os.getpid()):
            continue
        fields = _stat(int(name))
        if fields is not None and int(fields[1]) == launcher:
            found.append(int(name))
    return found


def _stat(pid: int) -> Optional[list[str]]:
    """/proc/PID/stat from the state on (the command before it may hold spaces)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as handle:
            text = handle.read()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()


def _running(pid: int) -> bool:
    fields = _stat(pid)
    return fields is not None and fields[0] not in ("Z", "X")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
