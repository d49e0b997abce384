"""Allreduce through the node's shared memory, for a transport whose ranks all share one
host: what the torch transport reduces host data with instead of Gloo's TCP over
loopback (hvdlite/transport/torch_transport.py; HVDLITE_SHARED_MEMORY).

Each rank maps one segment of every rank's: a header (its arrival counter) and two
halves of ``HALF_BYTES``. A buffer is reduced in chunks of one half each:

1. every rank copies its chunk into its own segment, then arrives;
2. once all have arrived, rank r reduces slice r of every rank's chunk, in rank order,
   into its own segment, then arrives;
3. once all have arrived, every rank copies each slice k from rank k's segment.

Every rank copies the same bytes, so the result is bitwise identical on every rank
by construction. Chunks alternate between the halves: a rank writes the next chunk
into the half nobody reads any more (everyone left step 3 of the chunk before last
ahead of the last arrival).

An arrival is a counter stored in the rank's own header and read by the others; a rank
that waits for it sleeps on it (hvdlite/transport/futex.py), and the rank that stores it
wakes its sleepers. That the data written before it is seen before it relies on the
x86-64 memory model (stores are seen in order); elsewhere, and where the ranks do not
share a host, ``open_node_memory`` returns None and the transport's own collective is
used. A waiting rank checks its late peers' processes, so a peer that exited fails the
allreduce within ``CHECK_S`` instead of hanging it; on the engine's thread it also runs
the engine's liveness tick, so a peer that stopped answering (SIGSTOP, a debugger) fails
it after HVDLITE_PEER_TIMEOUT.
"""
from __future__ import annotations

import array
import errno
import logging
import mmap
import os
import platform
import time
from typing import Any, Optional, Sequence

import numpy as np

from hvdlite.errors import PeerLostError
from hvdlite.reduce_op import UFUNCS, ReduceOp
from hvdlite.transport import futex, waits
from hvdlite.transport.base import DATA_OPS
from hvdlite.transport.peers import EXITED, Peer, identity, process_state

_log = logging.getLogger("hvdlite")

HALF_BYTES = 2 << 20        # a chunk: 1-4 MiB reduced fastest here (BENCHMARKS.md)
HEADER_BYTES = 4096         # counters and round vectors; keeps the halves page-aligned
_ROUNDS_AT, _VECTORS_AT = 8, 64       # byte offsets in the header (the arrivals at 0)
ROUND_WORDS = (HEADER_BYTES - _VECTORS_AT) // 16    # two slots of a round's vector
CHECK_S = 0.1               # how often a waiting rank checks its late peers' processes
# A rank waiting inside an allreduce yields the core this many times, then sleeps on
# the late peer's counter. Longer spins took CPU that training needed: 2,000 yields cost
# the MLP 10 ms of engine CPU a step at np=4 on 2 cores (4 ms with 0-50), and 20,000
# where ranks had a core each cost the transformer 18 ms against 12 at np=2 (34.9
# samples/s against 33.5), now that the sleep ends at the peer's arrival.
YIELD_SPINS = 50
_KINDS = frozenset("biufc")     # NumPy's own numbers; any other dtype takes the transport


class NodeMemory:
    """One transport's segments, mapped; made by ``open_node_memory``."""

    def __init__(self, rank: int, peers: Sequence[Peer], maps: Sequence[mmap.mmap],
                 timeout_s: float, half_bytes: int) -> None:
        self.rank, self.size, self._peers = rank, len(maps), list(peers)
        self._maps, self._half, self._timeout_s = list(maps), half_bytes, timeout_s
        self._counters = [np.frombuffer(m, dtype=np.int64, count=1) for m in maps]
        self._arrival_words = [futex.Word(counter) for counter in self._counters]
        self.round_counters = [np.frombuffer(m, dtype=np.int64, count=1, offset=_ROUNDS_AT)
                               for m in maps]
        self.round_words = [futex.Word(counter) for counter in self.round_counters]
        self.round_slots = [np.frombuffer(m, dtype=np.uint64, count=2 * ROUND_WORDS,
                                          offset=_VECTORS_AT).reshape(2, ROUND_WORDS)
                            for m in maps]
        self._halves = [np.frombuffer(m, dtype=np.uint8, offset=HEADER_BYTES) for m in maps]
        self._scratch = np.empty(half_bytes, dtype=np.uint8)
        self._arrivals, self._next_half = 0, 0

    @staticmethod
    def reduces(dtype: np.dtype, op: ReduceOp) -> bool:
        return dtype.kind in _KINDS and op in DATA_OPS

    def allreduce(self, buf: np.ndarray, op: ReduceOp) -> None:
        """``buf`` (contiguous) reduced in place with ``op`` across the ranks."""
        ufunc = UFUNCS[op]
        for chunk in self.chunks(buf):
            views = self.post(chunk)
            self.await_peers()
            self.reduce_slice(views, chunk.size, ufunc)
            self.await_peers()
            self.copy_back(views, chunk)

    # The steps of one chunk (the module's docstring), each without waiting; between
    # them every rank must have arrived (``late`` is empty): ``allreduce`` waits for
    # that, a lane's sum (hvdlite/transport/node_lane.py) tests it.
    def chunks(self, buf: np.ndarray) -> list[np.ndarray]:
        flat = buf.reshape(-1)
        per_chunk = self._half // flat.itemsize
        return [flat[start: start + per_chunk] for start in range(0, flat.size, per_chunk)]

    def post(self, chunk: np.ndarray, at: int = 0, count: Optional[int] = None
             ) -> list[np.ndarray]:
        """Step 1: the chunk into this rank's segment, then arrive; every rank's view of
        the half it went to. ``count``: the views hold that many elements, and ``chunk``
        goes ``at`` elements in (an allgather's part)."""
        half, self._next_half = self._next_half, 1 - self._next_half
        begin = half * self._half
        nbytes = chunk.nbytes if count is None else count * chunk.itemsize
        views = [h[begin: begin + nbytes].view(chunk.dtype) for h in self._halves]
        views[self.rank][at:at + chunk.size] = chunk
        self._arrive()
        return views

    def reduce_slice(self, views: list[np.ndarray], count: int, ufunc: np.ufunc) -> None:
        """Step 2: this rank's slice of every rank's chunk reduced in rank order into its
        own segment, then arrive."""
        lo, hi = self._slice(count, self.rank)
        parts = [view[lo:hi] for view in views]
        scratch = self._scratch[: (hi - lo) * views[0].itemsize].view(views[0].dtype)
        total = parts[0]
        for k in range(1, self.size):
            # In rank order; the running total goes to this rank's own part once that
            # part has been added in (before, to scratch: it is still an input).
            into = parts[self.rank] if k >= self.rank else scratch
            ufunc(total, parts[k], out=into)
            total = into
        self._arrive()

    def copy_back(self, views: list[np.ndarray], chunk: np.ndarray, keep: slice = slice(None)
                  ) -> None:
        """Step 3: every slice k from rank k's segment; ``keep``: only those elements of
        the chunk (a reduce-scatter's part)."""
        first, last, _ = keep.indices(chunk.size)
        for k, view in enumerate(views):
            lo, hi = self._slice(chunk.size, k)
            lo, hi = max(lo, first), min(hi, last)
            if lo < hi:
                chunk[lo:hi] = view[lo:hi]

    def late(self) -> list[int]:
        """The ranks that have not arrived where this one has."""
        arrivals, counters = self._arrivals, self._counters
        return [k for k in range(self.size) if counters[k][0] < arrivals]

    def await_peers(self) -> None:
        late = self.late()
        if late:
            self._await(late, self._arrivals)

    def _slice(self, count: int, k: int) -> tuple[int, int]:
        return count * k // self.size, count * (k + 1) // self.size

    def _arrive(self) -> None:
        self._arrivals += 1
        self._counters[self.rank][0] = self._arrivals
        self._arrival_words[self.rank].wake()

    def _await(self, late: list[int], arrivals: int) -> None:
        """Until every rank of ``late`` has arrived ``arrivals`` times: yielding the core
        at first (peers here are usually microseconds away), then asleep on the
        counter of the first late rank, checking the late ranks every CHECK_S (and,
        on the engine's thread, running its liveness tick)."""
        counters = self._counters
        for _ in range(YIELD_SPINS):
            os.sched_yield()
            late = [k for k in late if counters[k][0] < arrivals]
            if not late:
                return
        started = time.monotonic()
        next_check = started + CHECK_S
        while late:
            seen = int(counters[late[0]][0])
            if seen < arrivals:
                self._arrival_words[late[0]].wait(seen, next_check - time.monotonic())
            late = [k for k in late if counters[k][0] < arrivals]
            now = time.monotonic()
            if late and now >= next_check:
                self.check_peers(late, now - started)
                # On the engine's thread, its liveness tick: a late peer that stopped
                # answering is named after HVDLITE_PEER_TIMEOUT (hvdlite/transport/waits.py).
                waits.tick_if_watched(started, now)
                next_check = now + CHECK_S

    def check_peers(self, late: Sequence[int], waited_s: float) -> None:
        for k in late:
            if process_state(self._peers[k]) == EXITED:
                raise PeerLostError(
                    f"rank {self.rank}: rank {k} (pid {self._peers[k].pid}) exited during an "
                    "allreduce through the node's shared memory; the job cannot continue "
                    "without it (its own log has the cause)")
        if waited_s > self._timeout_s:
            raise PeerLostError(
                f"rank {self.rank}: ranks {list(late)} did not reach an allreduce through "
                f"the node's shared memory within {self._timeout_s:.0f} s, though their "
                "processes run; a stopped or stuck process (see its stack with py-spy dump)")

    def band_round(self, vector: array.array) -> Optional[NodeRound]:
        """The negotiation round over ``vector`` through the segments' headers; None for
        a vector longer than ROUND_WORDS (a cache of over 16,000 responses)."""
        return NodeRound(self, vector) if len(vector) <= ROUND_WORDS else None

    def close(self) -> None:
        """Unmap the segments (nothing else holds them: each goes with its last mapping)."""
        self._counters, self._halves, self._arrival_words = [], [], []
        self.round_counters, self.round_slots, self.round_words = [], [], []
        for m in self._maps:
            m.close()
        self._maps = []


class NodeRound:
    """A bitwise-AND round (hvdlite/transport/base.py's BandRound) through shared
    memory: ``start`` stores the vector in this rank's slot of the round, then the
    round's number; the round is complete once every rank's number has reached it,
    and its result is the AND of every rank's slot. Rounds alternate between two
    slots: a rank writes round t+2 into round t's slot only after every rank started
    round t+1, so after each had read round t. A peer that never starts is the
    engine's to find, as with any round (its liveness check runs while it waits)."""

    def __init__(self, memory: NodeMemory, vector: array.array) -> None:
        self._memory, self._words = memory, len(vector)
        self._vector = np.frombuffer(vector, dtype=np.uint64)
        self._started = 0

    def start(self) -> NodeRoundPending:
        self._started += 1
        memory, number = self._memory, self._started
        memory.round_slots[memory.rank][number % 2, : self._words] = self._vector
        memory.round_counters[memory.rank][0] = number     # stored after the vector
        memory.round_words[memory.rank].wake()
        return NodeRoundPending(self, number)

    def sleep(self, number: int, timeout_s: float) -> None:
        """Asleep on the first rank that has not started round ``number``, up to
        ``timeout_s``; returns at once if every rank has."""
        memory = self._memory
        for rank, counter in enumerate(memory.round_counters):
            seen = int(counter[0])
            if seen < number:
                memory.round_words[rank].wait(seen, timeout_s)
                return

    def finish(self, number: int) -> bool:
        """Whether round ``number`` is complete; if so, the vector holds its AND."""
        memory = self._memory
        if any(counter[0] < number for counter in memory.round_counters):
            return False
        slots = [slot[number % 2, : self._words] for slot in memory.round_slots]
        np.bitwise_and.reduce(slots, out=self._vector)
        return True

    def free(self) -> None:
        pass


class NodeRoundPending:
    """A started NodeRound: tested as an MPI request is (a test reads one counter a
    rank), or waited on asleep (transport.BlockingPending): the engine's rounds wait
    for ranks still in their backward pass, up to ~0.1 s, and polled, each wait cost
    the engine hundreds of wake-ups (BENCHMARKS.md, "rounds sleep on a futex")."""

    def __init__(self, node_round: NodeRound, number: int) -> None:
        self._round, self._number, self._done = node_round, number, False

    def Test(self) -> bool:  # noqa: N802 (the Pending protocol's name)
        if not self._done:
            self._done = self._round.finish(self._number)
        return self._done

    def wait_for(self, timeout_s: float) -> bool:
        """Asleep until complete or ``timeout_s`` has passed; True once complete."""
        deadline = time.monotonic() + timeout_s
        while not self.Test():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._round.sleep(self._number, left)
        return True


def _unsupported_here() -> Optional[str]:
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return f"{platform.system()} on {platform.machine()} (x86-64 Linux only)"
    if not futex.available():
        return "no futex through libc's syscall"
    if not hasattr(os, "memfd_create"):
        return "no os.memfd_create in this Python"
    return None


def open_node_memory(transport: Any, half_bytes: int = HALF_BYTES, timeout_s: float = 1800.0,
                     host: Optional[str] = None) -> Optional[NodeMemory]:
    """Collective over ``transport``'s ranks: every rank's segment mapped by every rank,
    or None on every rank, with the reason logged by rank 0, where the ranks do not
    share a host (``host``: this one's name), or a segment could not be made or
    opened by a peer. Segments have no name, so another process can neither take one
    nor be left with one."""
    me = identity(transport.rank)
    facts = transport.allgather((host or me.host, me, _unsupported_here()))
    peers = [peer for _, peer, _ in facts]
    reason = next((why for _, _, why in facts if why), None)
    if reason is None and len({host for host, _, _ in facts}) > 1:
        reason = "the ranks are on more than one host"
    if reason is None and (peers[0].domain is None or
                           any(peer.domain != peers[0].domain for peer in peers)):
        # peers.Peer.domain: only processes of one domain can tell an exited peer
        # from a late one through /proc.
        reason = "the ranks cannot see each other's processes (another pid namespace)"
    if reason is None:
        memory, reason = _map_segments(transport, peers, half_bytes, timeout_s)
        if memory is not None:
            return memory
    if transport.rank == 0:
        _log.info("hvdlite: host data over %s, not shared memory: %s", transport.name, reason)
    return None


def _map_segments(transport: Any, peers: Sequence[Peer], half_bytes: int,
                  timeout_s: float) -> tuple[Optional[NodeMemory], str]:
    """Each rank makes its own segment, anonymous memory (memfd), then maps every rank's
    through its owner's descriptor (/proc/PID/fd/FD: the kernel lets only processes
    that may read the owner's memory open it, so not another user's); each step
    agreed by every rank (an allgather of what failed) before the next. The owner
    holds its descriptor until every rank has mapped it or given up; from then on the
    mappings alone hold the memory, and it goes with the last of them, whichever way
    its processes end."""
    size = HEADER_BYTES + 2 * half_bytes
    fd, error = _create(transport.rank, size)
    maps: list[mmap.mmap] = []
    try:
        made = transport.allgather((error, None if fd is None else _handle(fd)))
        failed = [e for e, _ in made if e]
        if not failed:
            maps, error = _map_all(transport.rank, [h for _, h in made], size)
            failed = [e for e in transport.allgather(error) if e]
    finally:
        if fd is not None:
            os.close(fd)
    if failed:
        for m in maps:
            m.close()
        return None, failed[0]
    return NodeMemory(transport.rank, peers, maps, timeout_s, half_bytes), ""


def _create(rank: int, size: int) -> tuple[Optional[int], Optional[str]]:
    try:
        fd = os.memfd_create("hvdlite", os.MFD_CLOEXEC)
    except OSError as exc:
        return None, f"rank {rank} could not make a segment: {exc}"
    try:
        # Reserves the pages now: memory that runs out fails here, not with SIGBUS later.
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        os.close(fd)
        return None, f"rank {rank} could not reserve its segment ({size} bytes): {exc}"
    return fd, None


def _handle(fd: int) -> tuple[int, int, int, int]:
    """What a peer needs to open the segment behind ``fd``, and to know it for this one
    (device and inode: a pid reused since could hold another file under that number)."""
    stat = os.fstat(fd)
    return os.getpid(), fd, stat.st_dev, stat.st_ino


def _map_all(rank: int, handles: Sequence[tuple[int, int, int, int]],
             size: int) -> tuple[list[mmap.mmap], Optional[str]]:
    """Every rank's segment mapped, or none and why not."""
    maps: list[mmap.mmap] = []
    for owner, handle in enumerate(handles):
        try:
            maps.append(_map(handle, size))
        except OSError as exc:
            for m in maps:
                m.close()
            hint = (" (a process may open another's only if it may read that one's memory: "
                    "the same user, and not made undumpable)"
                    if isinstance(exc, PermissionError) else "")
            return [], f"rank {rank} could not map rank {owner}'s segment: {exc}{hint}"
    return maps, None


def _map(handle: tuple[int, int, int, int], size: int) -> mmap.mmap:
    pid, number, device, inode = handle
    path = f"/proc/{pid}/fd/{number}"
    fd = os.open(path, os.O_RDWR)
    try:
        stat = os.fstat(fd)
        if (stat.st_dev, stat.st_ino) != (device, inode):
            raise FileNotFoundError(errno.ESRCH, "its process has ended", path)
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)
