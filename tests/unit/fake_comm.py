"""Stand-ins for an MPI communicator, so that the host backends can be unit-tested
at any size in one process (found necessary by make mutate on hvdlite/backends:
the MPI stages run at 2 ranks, where a ring has one step and nothing is odd).
Backends take a transport: a test opens them on the real MPI transport over one of
these (``MpiTransport(comm)``), and tests/unit/fake_transport.py's in-process transport
has one as its ``comm``, so there is one fake world, seen through MPI's calls.

``run_ranks`` runs one thread per rank over a :class:`ThreadWorld`, whose
point-to-point calls (Isend, Irecv, Send, Recv, Sendrecv) behave like MPI's: messages between two ranks with one tag
arrive in order, a receive waits for its message (a missing one fails the test
after ``TIMEOUT`` seconds instead of hanging it), a message longer than the
receive buffer is an error and a shorter one fills its start. The collectives
that hvdlite/backends/mpi.py calls (Allreduce, in place too, Bcast, Allgatherv,
Alltoallv, Reduce_scatter, and their nonblocking forms, complete when called) are
exchanges through a shared slot per rank between two barriers, with MPI's semantics
computed by NumPy, reducing in rank order (and the pickled ``allgather`` and ``bcast``
that hvdlite/backends/nccl.py calls); a count that does not match the buffers is an
error, as MPI would truncate, and so are overlapping send and receive buffers of
Allgatherv and Alltoallv.
:class:`RecordingComm` records the collectives called on it and does nothing.
"""
from __future__ import annotations

import copy
import queue
import threading
from types import SimpleNamespace
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

TIMEOUT = 10.0


class Request:
    """A point-to-point request: ``Wait`` runs the receive's copy once; so does ``Test``,
    which is then true (a nonblocking collective here completes as it is called)."""

    def __init__(self, complete: Callable[[], None] | None = None) -> None:
        self._complete = complete

    def Wait(self) -> None:  # noqa: N802 (mpi4py's name)
        if self._complete is not None:
            complete, self._complete = self._complete, None
            complete()

    def Test(self) -> bool:  # noqa: N802
        self.Wait()
        return True

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
        self.sent_bytes = [0] * size        # point-to-point bytes each rank sent
        self.collectives = 0                # collective calls, counted once per rank
        self._slots: list[Any] = [None] * size
        self._barrier = threading.Barrier(size)

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
            self.world.sent_bytes[self.rank] += np.asarray(buf).nbytes
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

    def Sendrecv(self, sendbuf: np.ndarray, dest: int, sendtag: int,  # noqa: N802
                 recvbuf: np.ndarray, source: int, recvtag: int) -> None:
        self.Isend(sendbuf, dest, sendtag)     # buffered: the send never blocks
        self.Recv(recvbuf, source, recvtag)

    # -- collectives -----------------------------------------------------------------
    def _exchange(self, item: Any) -> list[Any]:
        """Every rank's ``item``, in rank order (a rank that never comes fails the
        others' barrier after ``TIMEOUT`` seconds)."""
        world = self.world
        with world._lock:
            world.collectives += 1
        world._slots[self.rank] = item
        world._barrier.wait(TIMEOUT)
        items = list(world._slots)
        world._barrier.wait(TIMEOUT)        # nobody overwrites a slot still being read
        return items

    # Lower case: mpi4py's pickled objects (each rank gets its own copy).
    def allgather(self, item: Any) -> list[Any]:
        return copy.deepcopy(self._exchange(item))

    def bcast(self, item: Any, root: int = 0) -> Any:
        return copy.deepcopy(self._exchange(item if self.rank == root else None)[root])

    def Allreduce(self, sendbuf: Any, recvbuf: np.ndarray, op: Any) -> None:  # noqa: N802
        data = recvbuf if sendbuf is MPI.IN_PLACE else np.asarray(sendbuf)
        if data.dtype != recvbuf.dtype or data.size != recvbuf.size:
            raise ValueError(f"rank {self.rank}: Allreduce of {data.size} {data.dtype} "
                             f"into {recvbuf.size} {recvbuf.dtype}")
        recvbuf[...] = _reduce(self._exchange(data.reshape(-1).copy()), op).reshape(recvbuf.shape)

    def Bcast(self, buf: Any, root: int) -> None:  # noqa: N802
        array = _array(buf)
        data = self._exchange(array.copy() if self.rank == root else None)[root]
        if data.dtype != array.dtype or data.size != array.size:
            raise ValueError(f"rank {self.rank}: Bcast of {data.size} {data.dtype} "
                             f"into {array.size} {array.dtype}")
        array[...] = data

    def Allgatherv(self, sendbuf: Any, recvbuf: Any) -> None:  # noqa: N802
        send = _array(sendbuf).reshape(-1)
        recv, (counts, displs) = _array(recvbuf).reshape(-1), recvbuf[1]
        _not_aliased(send, recv, self.rank)
        pieces = self._exchange(send.copy())
        for source, piece in enumerate(pieces):
            _place(recv, displs[source], counts[source], piece, self.rank, source)

    def Alltoallv(self, sendbuf: Any, recvbuf: Any) -> None:  # noqa: N802
        send, (send_counts, send_displs) = _array(sendbuf).reshape(-1), sendbuf[1]
        recv, (recv_counts, recv_displs) = _array(recvbuf).reshape(-1), recvbuf[1]
        _not_aliased(send, recv, self.rank)
        sent = self._exchange((send.copy(), list(send_counts), list(send_displs)))
        for source, (data, counts, displs) in enumerate(sent):
            piece = data[displs[self.rank]: displs[self.rank] + counts[self.rank]]
            if len(piece) != counts[self.rank]:
                raise ValueError(f"rank {source} sends past its buffer to rank {self.rank}")
            _place(recv, recv_displs[source], recv_counts[source], piece, self.rank, source)

    def Reduce_scatter(self, sendbuf: np.ndarray, recvbuf: np.ndarray,  # noqa: N802
                       recvcounts: Any, op: Any) -> None:
        counts = list(recvcounts)
        if sum(counts) != sendbuf.size or recvbuf.size != counts[self.rank]:
            raise ValueError(f"rank {self.rank}: Reduce_scatter of {sendbuf.size} into "
                             f"{recvbuf.size} with counts {counts}")
        total = _reduce(self._exchange(sendbuf.reshape(-1).copy()), op)
        start = sum(counts[: self.rank])
        recvbuf.reshape(-1)[...] = total[start: start + counts[self.rank]]

    # The nonblocking forms the backends call: each completes before it returns.
    def Iallreduce(self, *args: Any, **kwargs: Any) -> Request:  # noqa: N802
        self.Allreduce(*args, **kwargs)
        return Request()

    def Ibcast(self, *args: Any, **kwargs: Any) -> Request:  # noqa: N802
        self.Bcast(*args, **kwargs)
        return Request()

    def Iallgatherv(self, *args: Any, **kwargs: Any) -> Request:  # noqa: N802
        self.Allgatherv(*args, **kwargs)
        return Request()

    def Ialltoallv(self, *args: Any, **kwargs: Any) -> Request:  # noqa: N802
        self.Alltoallv(*args, **kwargs)
        return Request()

    def Ireduce_scatter(self, *args: Any, **kwargs: Any) -> Request:  # noqa: N802
        self.Reduce_scatter(*args, **kwargs)
        return Request()


_UFUNCS = [(MPI.SUM, np.add), (MPI.PROD, np.multiply), (MPI.MIN, np.minimum),
           (MPI.MAX, np.maximum)]


def _reduce(items: list[np.ndarray], op: Any) -> np.ndarray:
    """Every rank's buffer reduced by the MPI ``op``, in rank order."""
    (ufunc,) = [u for mpi_op, u in _UFUNCS if mpi_op == op]
    if any(i.dtype != items[0].dtype or i.size != items[0].size for i in items):
        raise ValueError(f"ranks reduce different buffers: {[(i.size, i.dtype) for i in items]}")
    result = items[0].copy()
    for item in items[1:]:
        ufunc(result, item, out=result)
    return result


def _not_aliased(send: np.ndarray, recv: np.ndarray, rank: int) -> None:
    """MPI forbids overlapping send and receive buffers (MPICH rejects equal pointers;
    other overlaps are silently wrong): this fake copies first, so it must check."""
    if send.size and recv.size and np.shares_memory(send, recv):
        raise ValueError(f"rank {rank}: the send and receive buffers overlap")


def _array(spec: Any) -> np.ndarray:
    """The array of an mpi4py buffer spec ([array, type] or [array, (counts, displs), type])."""
    return spec[0] if isinstance(spec, (list, tuple)) else spec


def _place(recv: np.ndarray, start: int, count: int, piece: np.ndarray, rank: int,
           source: int) -> None:
    if piece.dtype != recv.dtype or piece.size != count or start + count > recv.size:
        raise ValueError(f"rank {rank}: {piece.size} {piece.dtype} from {source} into "
                         f"{count} at {start} of {recv.size} {recv.dtype}")
    recv[start: start + count] = piece


def run_threads(size: int, work: Callable[[int], Any],
                on_error: Callable[[], None]) -> tuple[list[Any], list[BaseException]]:
    """``work(rank)`` on every rank, each in its own thread: (results in rank order,
    the exceptions raised). The first exception calls ``on_error`` so the other ranks
    fail now rather than after TIMEOUT; every thread must have ended."""
    results: list[Any] = [None] * size
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            results[rank] = work(rank)
        except BaseException as error:   # noqa: BLE001 (returned to the caller)
            errors.append(error)
            on_error()
    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(4 * TIMEOUT)
    if not errors:
        assert not any(t.is_alive() for t in threads), "a rank never finished"
    return results, errors


def run_ranks(size: int, work: Callable[[ThreadComm], Any]) -> list[Any]:
    """``work(comm)`` on every rank of a fresh world, each in its own thread; the
    results in rank order. Any rank's exception is raised (after every thread ends)."""
    world = ThreadWorld(size)
    results, errors = run_threads(size, lambda rank: work(ThreadComm(world, rank)),
                                  world._barrier.abort)
    if errors:
        raise errors[0]
    assert world.undelivered() == 0, "messages were sent that nobody received"
    return results


class RecordingComm:
    """A communicator of ``size`` ranks seen from ``rank`` whose collectives only
    record their names (for what a backend counts and when it calls MPI at all), and
    return a completed request."""

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

        def record(*args: Any, **kwargs: Any) -> Request:
            self.calls.append(name)
            return Request()
        return record
