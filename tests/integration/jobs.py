"""Small programs that the integration tests run as whole MPI jobs."""
from __future__ import annotations

import os
import sys
import time

import numpy as np

import hvdlite as hvd


def crash() -> None:
    """The last rank raises; the others wait in a collective that can never finish."""
    hvd.init()
    if hvd.rank() == hvd.size() - 1:
        raise RuntimeError("deliberate failure on the last rank")
    hvd.allreduce(np.ones(4), name="never.completes")


def stall_shutdown() -> None:
    """Rank 0 waits on a tensor the others never submit."""
    hvd.init()
    try:
        if hvd.rank() == 0:
            hvd.allreduce(np.ones(2), name="lonely")
        else:
            time.sleep(5)
            hvd.allreduce(np.ones(2), name="elsewhere")
    except hvd.StallError as exc:
        print(f"STALL_ERROR rank {hvd.rank()}: {exc}", flush=True)
        sys.exit(0)
    print(f"NO_ERROR rank {hvd.rank()}", flush=True)
    sys.exit(3)


def early_shutdown() -> None:
    """Rank 0 shuts down; the others' later collectives must fail, not hang."""
    hvd.init()
    hvd.barrier()
    if hvd.rank() == 0:
        hvd.shutdown()
        print("SHUTDOWN rank 0", flush=True)
        return
    time.sleep(0.5)
    try:
        hvd.allreduce(np.ones(2), name="after.peer.shutdown")
    except hvd.ShutdownError as exc:
        print(f"SHUTDOWN_ERROR rank {hvd.rank()}: {exc}", flush=True)
        return
    sys.exit(4)


def timeline_env() -> None:
    hvd.init()
    for step in range(3):
        hvd.allreduce(np.ones(10), name="env.timeline")
    hvd.shutdown()


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    globals()[sys.argv[1]]()
