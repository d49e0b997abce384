"""Stand-ins for an MPI communicator, so that the host backends can be unit-tested
at any size in one process (found necessary by make mutate on hvdlite/backends:
the MPI stages run at 2 ranks, where a ring has one step and nothing is odd).

``run_ranks`` runs one thread per rank over a :class:`ThreadWorld`, whose
point-to-point calls behave like MPI's: messages between two ranks with one tag
arrive in order, a receive waits for its message (a missing one fails the test
after ``TIMEOUT`` seconds instead of hanging it), a message longer than the
receive buffer is an error and a shorter one fills its start.
:class:`RecordingComm` records the collectives called on it and does nothing.
"""
from __future__ import annotations

import queue
import threading
from types import SimpleNamespace
from typing import Any, Callable

import numpy as np

TIMEOUT = 10.0


class Request:
    """A point-to-point request: ``Wait`` runs the receive's copy once."""

    def __init__(self, complete: Callable[[], None] | None = None) -> None:
        self._complete = complete

    def Wait(self) -> None:  # noqa: N802 (mpi4py's name)
        if self._complete is not None:
            complete, self._complete = self._complete, None
            complete()

    @staticmethod
    def Waitall(requests: list[Request]) -> None:  # noqa: N802
        for request in requests:
            request.Wait()


# What the backends use of the mpi4py module, for monkeypatching theirs.
FAKE_MPI = SimpleNamespace(Request=Request)


class ThreadWorld:
    def __init__(self, size: int) -> None:
        self.size = size
        self._queues: dict[tuple[int, int, int], queue.Queue] = {}
        self._lock = threading.Lock()
        self.messages = 0

    def channel(self, source: int, dest: int, tag: int) -> queue.Queue:
        with self._lock:
            return self._queues.setdefault((source, dest, tag), queue.Queue())

    def undelivered(self) -> int:
        return sum(q.qsize() for q in self._queues.values())


class ThreadComm:
    def __init__(self, world: ThreadWorld, rank: int) -> None:
        self.world, self.rank = world, rank

    def Get_rank(self) -> int:  # noqa: N802
        return self.rank

    def Get_size(self) -> int:  # noqa: N802
        return self.world.size

    def _check_peer(self, peer: int) -> None:
        if not 0 <= peer < self.world.size or peer == self.rank:
            raise ValueError(f"rank {self.rank}: message to or from rank {peer}")

    def Isend(self, buf: np.ndarray, dest: int, tag: int) -> Request:  # noqa: N802
        self._check_peer(dest)
        with self.world._lock:
            self.world.messages += 1
        self.world.channel(self.rank, dest, tag).put(np.array(buf, copy=True))
        return Request()

    def Send(self, buf: np.ndarray, dest: int, tag: int) -> None:  # noqa: N802
        self.Isend(buf, dest, tag)

    def Irecv(self, buf: np.ndarray, source: int, tag: int) -> Request:  # noqa: N802
        self._check_peer(source)
        channel = self.world.channel(source, self.rank, tag)

        def complete() -> None:
            try:
                data = channel.get(timeout=TIMEOUT)
            except queue.Empty:
                raise TimeoutError(f"rank {self.rank}: nothing from {source} (tag {tag})") from None
            if data.dtype != buf.dtype or data.size > buf.size:
                raise ValueError(f"rank {self.rank}: {data.size} {data.dtype} from {source} "
                                 f"into {buf.size} {buf.dtype}")
            buf[: data.size] = data
        return Request(complete)

    def Recv(self, buf: np.ndarray, source: int, tag: int) -> None:  # noqa: N802
        self.Irecv(buf, source, tag).Wait()


def run_ranks(size: int, work: Callable[[ThreadComm], Any]) -> list[Any]:
    """``work(comm)`` on every rank of a fresh world, each in its own thread; the
    results in rank order. Any rank's exception is raised (after every thread ends)."""
    world = ThreadWorld(size)
    results: list[Any] = [None] * size
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            results[rank] = work(ThreadComm(world, rank))
        except BaseException as error:   # noqa: BLE001 (reported below)
            errors.append(error)
    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(4 * TIMEOUT)
    if errors:
        raise errors[0]
    assert not any(t.is_alive() for t in threads), "a rank never finished"
    assert world.undelivered() == 0, "messages were sent that nobody received"
    return results


class RecordingComm:
    """A communicator of ``size`` ranks seen from ``rank`` whose collectives only
    record their names (for what a backend counts and when it calls MPI at all)."""

    def __init__(self, size: int, rank: int = 0) -> None:
        self.size, self.rank = size, rank
        self.calls: list[str] = []

    def Get_rank(self) -> int:  # noqa: N802
        return self.rank

    def Get_size(self) -> int:  # noqa: N802
        return self.size

    def __getattr__(self, name: str) -> Callable[..., None]:
        if not name[:1].isupper():
            raise AttributeError(name)
        return lambda *args, **kwargs: self.calls.append(name)
