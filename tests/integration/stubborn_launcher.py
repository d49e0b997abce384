"""A stand-in "mpiexec" that ignores SIGTERM (as MPICH's does while it spins before
starting any rank), for tests/integration/test_launcher_stop.py.

``--version`` answers as MPICH's hydra, so hvdliterun takes it for one. Otherwise it
starts a child that ignores SIGTERM too (a rank, a proxy), writes its own pid and the
child's to $STUBBORN_PIDS (one line, ended once both are there) and waits for ever.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

if __name__ == "__main__":
    if sys.argv[1:] == ["--version"]:
        print("HYDRA build details:\n    Version: 4.2.0")
        sys.exit(0)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)      # inherited by the child
    child = subprocess.Popen(["sleep", "300"])
    with open(os.environ["STUBBORN_PIDS"], "w") as handle:
        handle.write(f"{os.getpid()} {child.pid}\n")
    while True:
        time.sleep(60)
