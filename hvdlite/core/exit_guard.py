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
the surviving ranks detect the loss (hvdlite.core.liveness), raise
PeerLostError and abort the job with a non-zero status.

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
    # takes the guard with it. No stdio: hydra decides a rank has ended when its
    # stdout and stderr close, so the guard must not hold them.
    grace = peer_timeout + MARGIN_S
    try:
        _spawned = subprocess.Popen(
            [sys.executable, "-I", "-S", os.path.abspath(__file__), str(os.getpid()),
             str(fd), repr(float(grace))],
            pass_fds=(fd,), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, close_fds=True)
    except OSError as exc:   # without it, a silent exit may go unreported, as before
        logging.getLogger("hvdlite").warning(
            "could not start the exit guard (HVDLITE_EXIT_GUARD=0 skips it): %s", exc)
    return _spawned


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
    parent, fd, grace = int(argv[0]), int(argv[1]), float(argv[2])
    watch = select.poll()
    # Only "peer closed" (POLLRDHUP, plus the implied POLLHUP/POLLERR), never POLLIN:
    # the PMI replies on this socket belong to the rank, and the guard reads nothing.
    watch.register(fd, select.POLLRDHUP)
    if not _wait_for_parent(parent, watch, fd):
        return 0
    deadline = time.monotonic() + grace
    while (left := deadline - time.monotonic()) > 0:
        if watch.poll(left * 1000):
            break
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
