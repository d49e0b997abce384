"""Small programs that the integration tests run as whole MPI jobs."""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from typing import Callable

import numpy as np

import hvdlite as hvd


def crash() -> None:
    """The last rank raises; the others wait in a collective that can never finish."""
    hvd.init()
    if hvd.rank() == hvd.size() - 1:
        print("last rank: about to fail")   # buffered: must be flushed before the abort
        _losing()
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


def lane_kept_on_some_ranks() -> None:
    """Rank 0 lets go of a lane's owner; the others keep theirs to the end: the
    shutdown frees the lane on every rank, leaving no collective pending."""
    from hvdlite.api import runtime
    from hvdlite.api.lane import CHECK_WORDS, Lane
    hvd.init()
    owners = [Lane("kept", [3 + CHECK_WORDS], "float32", None)]
    if hvd.rank() == 0:
        owners.clear()
    hvd.barrier()
    engine = runtime.engine()
    hvd.shutdown()
    print(f"LANES rank {engine.transport.rank}: {engine.lanes.held} held after shutdown",
          flush=True)


def timeline_env() -> None:
    hvd.init()
    for step in range(3):
        hvd.allreduce(np.ones(10), name="env.timeline")
    hvd.shutdown()


def _say(line: str) -> None:
    """One write per line: print() writes the text and the newline separately, and the
    launcher may then interleave another rank's output between them."""
    os.write(1, (line + "\n").encode())


def _losing() -> None:
    """When this rank is lost, on the host's monotonic clock (the same in every
    process): tests time the job's end from it, not from the launch."""
    _say(f"LOSING rank {hvd.rank()} at {time.monotonic():.3f}")


def _announce_pids() -> None:
    """For the test's check that no process outlives the job."""
    try:
        from hvdlite.failure import exit_guard
        guard = exit_guard._spawned.pid if exit_guard._spawned is not None else -1
    except ImportError:     # a tree without the guard, when checking that tests fail there
        guard = -1
    _say(f"PIDS rank {hvd.rank()}: {os.getpid()} {guard}")


def _survive(lose_last_rank: Callable[[], None], steps_before: int = 5) -> None:
    """The last rank calls ``lose_last_rank`` after ``steps_before`` allreduces; the
    others keep reducing and must fail with PeerLostError. A survivor returns
    normally after printing it: its exit must still end the job non-zero."""
    hvd.init()
    _announce_pids()
    for _ in range(steps_before):
        hvd.allreduce(np.ones(4), name="step")
    if hvd.rank() == hvd.size() - 1:
        _losing()
        lose_last_rank()
    start = time.monotonic()
    try:
        for _ in range(100000):
            hvd.allreduce(np.ones(4), name="step")
    except hvd.PeerLostError as exc:
        _say(f"PEER_LOST rank {hvd.rank()} after {time.monotonic() - start:.1f} s: {exc}")
        return
    _say(f"NO_ERROR rank {hvd.rank()}")


def peer_exits_mid_training() -> None:
    _survive(lambda: os._exit(0))


def peer_exits_after_init() -> None:
    _survive(lambda: os._exit(0), steps_before=0)


def peer_freezes() -> None:
    _survive(lambda: os.kill(os.getpid(), signal.SIGSTOP))


def allreduce_loop() -> None:
    """Every rank reduces 64 MiB again and again (the ring's size: its blocking MPI_Wait
    calls hold the engine thread for most of the loop), for a test to kill one from
    outside; a survivor's PeerLostError is not caught."""
    hvd.init()
    _announce_pids()
    x = np.ones(16 << 20, dtype=np.float32)
    hvd.allreduce(x, name="big")
    _say(f"LOOPING rank {hvd.rank()}")
    while True:
        hvd.allreduce(x, name="big")


def frozen_in_collective() -> None:
    """Every rank runs one 64 MiB collective again and again (FROZEN_OP: "allreduce", or
    "broadcast_object" of a 64 MiB object); rank FROZEN_RANK (-1: the last) stops itself
    (SIGSTOP) on its engine's thread as the third one's data begins to move, once every
    rank has agreed to it: the others are inside that collective (MPI's, Gloo's or the
    node's shared memory), waiting for it. Each survivor says how long its own failing
    call lasted (it began before the stop: an upper bound on the time from the stop),
    and exits normally."""
    from hvdlite.engine import executor
    hvd.init()
    _announce_pids()
    victim = int(os.environ["FROZEN_RANK"]) % hvd.size()
    if hvd.rank() == victim:
        run, moved = executor.Executor.run, []

        def stop_in_the_third(self: executor.Executor, set_id: int, responses: list,
                              *args: object) -> None:
            if any(r.name in ("big", "big.data") for r in responses):
                moved.append(None)
                if len(moved) == 3:
                    os.kill(os.getpid(), signal.SIGSTOP)
            run(self, set_id, responses, *args)

        executor.Executor.run = stop_in_the_third  # type: ignore[method-assign]
    x = np.ones(16 << 20, dtype=np.float32)
    broadcast = os.environ.get("FROZEN_OP") == "broadcast_object"
    for _ in range(100000):
        start = time.monotonic()
        try:
            if broadcast:
                hvd.broadcast_object(x, root_rank=hvd.size() - 1 - victim, name="big")
            else:
                hvd.allreduce(x, op=hvd.Sum, name="big")
        except hvd.PeerLostError as exc:
            _say(f"PEER_LOST rank {hvd.rank()} after {time.monotonic() - start:.1f} s: {exc}")
            return
    _say(f"NO_ERROR rank {hvd.rank()}")


def stall_while_round_stuck() -> None:
    """Rank 0 waits on a tensor the others never submit; once rank 0's coordinator
    has seen that, the others' engines freeze (their main thread holds the GIL in
    C), so rank 0's negotiation round never completes."""
    hvd.init()
    _announce_pids()
    if hvd.rank() == 0:
        start = time.monotonic()
        try:
            hvd.allreduce(np.ones(2), name="lonely")
        except hvd.PeerLostError as exc:
            _say(f"PEER_LOST rank 0 after {time.monotonic() - start:.1f} s: {exc}")
        return
    time.sleep(1.5)
    _losing()
    ctypes.PyDLL(None).sleep(40)   # PyDLL keeps the GIL: the engine thread cannot run


def exit_status() -> None:
    """The last rank leaves through sys.exit(3) while the others wait on it."""
    hvd.init()
    hvd.barrier()
    if hvd.rank() == hvd.size() - 1:
        sys.exit(3)
    hvd.allreduce(np.ones(2), name="never.completes")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    globals()[sys.argv[1]]()
