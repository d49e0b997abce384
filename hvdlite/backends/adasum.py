"""Adasum: adaptive summation (Maleki et al., "AdaSum: Scaling Distributed
Training with Adaptive Summation") for allreduce of host float buffers over a
power-of-two process set.

The pairwise combination of two vectors a and b is

    adasum(a, b) = (1 - a.b / (2|a|^2)) a + (1 - a.b / (2|b|^2)) b

(a zero-norm vector keeps coefficient 1, as in a plain sum). Orthogonal
vectors add; equal vectors average. Across P = 2^k ranks it is applied as a
binary tree: at level d = 1, 2, 4, ... the partial results of the groups
{r : r // d == g} and {r : r // d == g ^ 1} are combined, so the result is
adasum over a fixed bracketing of the ranks (Horovod's order).

The runtime does this with vector halving and distance doubling (Horovod's
AdasumMPI), on the set's communicator, point-to-point:

* Reduce-scatter phase, level d: partner = rank ^ d. Both hold the same index
  range [lo, hi) of their group's partial result. The rank with bit d clear
  ("left") keeps the first half and sends the second, the other the reverse;
  each receives the partner's copy of the half it keeps.
* The coefficients need a.b, |a|^2 and |b|^2 over the WHOLE vectors of the two
  groups, but after the exchange each of the 2d ranks of the merged group
  {r : r // 2d == rank // 2d} holds a disjoint piece of both (their pieces
  tile [0, n)). So each rank computes partial sums on its piece (float64, as
  Horovod does, whatever the buffer's dtype), ordered as (dot, |left|^2,
  |right|^2) so that "a" means the left group's vector on every rank, and the
  merged group sums them by recursive doubling over partners rank ^ 1, ^ 2,
  ..., ^ d. IEEE addition is commutative, so both sides of every exchange
  compute the same sum and all 2d ranks get bit-identical coefficients.
* After log2(P) levels each rank owns 1/P of the result; an allgather by
  distance halving (the same partners in reverse) gives every rank all of it.

Each tensor is reduced on its own (the executor never fuses Adasum requests):
the coefficients are per tensor, as Horovod's per-tensor dot products in a
fused buffer make them.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
try:
    from mpi4py import MPI
except ImportError:     # no mpi4py (torchrun's transport): these backends decline every call
    MPI = None  # type: ignore[assignment]

from hvdlite.backends.base import DONE, Done, HostBackend
from hvdlite.reduce_op import ReduceOp
from hvdlite.transport.waits import wait_all

_TAG_HALVE, _TAG_DOTS, _TAG_GATHER = 81, 82, 83
_DOT_CHUNK = 1 << 16               # elements widened to float64 at a time
_TINY = float(np.sqrt(np.finfo(np.float64).tiny))   # Horovod's sqrt(DBL_MIN) threshold
_FLOATS = frozenset(np.dtype(t) for t in (np.float32, np.float64))


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def coefficients(dot: float, a_norm2: float, b_norm2: float) -> tuple[float, float]:
    """(coefficient of a, coefficient of b); a (near-)zero vector keeps 1."""
    ca = 1.0 - dot / (2.0 * a_norm2) if a_norm2 >= _TINY else 1.0
    cb = 1.0 - dot / (2.0 * b_norm2) if b_norm2 >= _TINY else 1.0
    return ca, cb


def pairwise(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """adasum(a, b) of two whole vectors (the reference the backend distributes)."""
    a64, b64 = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    ca, cb = coefficients(float(a64 @ b64), float(a64 @ a64), float(b64 @ b64))
    return (ca * a64 + cb * b64).astype(np.result_type(a, b)).reshape(np.shape(a))


def tree_reference(vectors: Sequence[np.ndarray]) -> np.ndarray:
    """adasum over ranks 0..P-1 with the backend's bracketing (P a power of two)."""
    level = list(vectors)
    if not is_power_of_two(len(level)):
        raise ValueError(f"Adasum needs a power-of-two number of vectors, got {len(level)}")
    while len(level) > 1:
        level = [pairwise(level[i], level[i + 1]) for i in range(0, len(level), 2)]
    return level[0]


def _partials(mine: np.ndarray, theirs: np.ndarray) -> tuple[float, float, float]:
    """(mine.theirs, |mine|^2, |theirs|^2) accumulated in float64 a chunk at a time,
    so float32 buffers are not copied whole."""
    dot = mine_sq = theirs_sq = 0.0
    for start in range(0, mine.size, _DOT_CHUNK):
        x = mine[start:start + _DOT_CHUNK].astype(np.float64, copy=False)
        y = theirs[start:start + _DOT_CHUNK].astype(np.float64, copy=False)
        # einsum's own loop, not BLAS: numpy's threaded BLAS spawns a thread per core,
        # and with a rank per core those threads fought over the cores, which made
        # these three products take milliseconds instead of microseconds.
        dot += float(np.einsum("i,i->", x, y))
        mine_sq += float(np.einsum("i,i->", x, x))
        theirs_sq += float(np.einsum("i,i->", y, y))
    return dot, mine_sq, theirs_sq


class AdasumBackend(HostBackend):
    """Allreduce with op=Adasum of float32/float64 host buffers (half types arrive
    widened to float32: see HostBackend.reduction_dtype)."""
    name = "adasum"

    def __init__(self) -> None:
        super().__init__()
        self._scratch = np.empty(0, dtype=np.uint8)

    def supports(self, kind: str, dtype: np.dtype, device: str, nbytes: int,
                 op: ReduceOp = ReduceOp.SUM) -> bool:
        return (op is ReduceOp.ADASUM and kind == "allreduce" and device == "cpu"
                and not self.declined)

    def allreduce(self, set_id: int, buf: np.ndarray, op: ReduceOp) -> Done:
        comm = self._comms[set_id]
        size = comm.Get_size()
        if not is_power_of_two(size):    # the API refuses these before submission
            raise ValueError(f"Adasum needs a power-of-two process set, got {size} ranks")
        if np.dtype(buf.dtype) not in _FLOATS:
            raise TypeError(f"Adasum reduces float32/float64 buffers, got {buf.dtype}")
        sent = received = 0
        if size > 1 and buf.size:
            ranges = self._reduce_scatter(comm, buf)
            sent = received = _moved(buf.itemsize, ranges)
            self._allgather(comm, buf, ranges)
        self.traffic.add("allreduce", sent, received)
        return DONE

    def _receive_buffer(self, dtype: np.dtype, count: int) -> np.ndarray:
        nbytes = count * dtype.itemsize
        if nbytes > self._scratch.nbytes:
            self._scratch = np.zeros(nbytes, dtype=np.uint8)
        return self._scratch[:nbytes].view(dtype)

    def _reduce_scatter(self, comm: MPI.Comm, buf: np.ndarray) -> list[tuple[int, int]]:
        """Vector halving, distance doubling; returns the range held before each level."""
        rank, size = comm.Get_rank(), comm.Get_size()
        lo, hi = 0, buf.size
        ranges: list[tuple[int, int]] = []
        level = 1
        while level < size:
            left = not rank & level
            mid = lo + (hi - lo) // 2
            keep, send = ((lo, mid), (mid, hi)) if left else ((mid, hi), (lo, mid))
            theirs = self._receive_buffer(buf.dtype, keep[1] - keep[0])
            _exchange(comm, buf[send[0]:send[1]], theirs, rank ^ level, _TAG_HALVE)
            mine = buf[keep[0]:keep[1]]
            dot, mine_sq, theirs_sq = _partials(mine, theirs)
            # Order as (dot, |left|^2, |right|^2) so the group's sums agree on which is a.
            local = np.array([dot, mine_sq, theirs_sq] if left else [dot, theirs_sq, mine_sq])
            dot, left_sq, right_sq = _group_sum(comm, rank, local, level)
            ca, cb = coefficients(dot, left_sq, right_sq)
            mine_coeff, theirs_coeff = (ca, cb) if left else (cb, ca)
            np.multiply(mine, mine_coeff, out=mine)
            np.multiply(theirs, theirs_coeff, out=theirs)
            np.add(mine, theirs, out=mine)
            ranges.append((lo, hi))
            lo, hi = keep
            level <<= 1
        ranges.append((lo, hi))
        return ranges

    @staticmethod
    def _allgather(comm: MPI.Comm, buf: np.ndarray, ranges: list[tuple[int, int]]) -> None:
        """Distance halving: at each level the partner holds the other half of the
        range both held before that level of the reduce-scatter."""
        rank = comm.Get_rank()
        lo, hi = ranges.pop()
        level = 1 << (len(ranges) - 1)
        while ranges:
            outer_lo, outer_hi = ranges.pop()
            # By the rank bit, not the bounds: a range of one element halves into an
            # empty half and a full one, whose starts coincide.
            other = (outer_lo, lo) if rank & level else (hi, outer_hi)
            _exchange(comm, buf[lo:hi], buf[other[0]:other[1]], rank ^ level, _TAG_GATHER)
            lo, hi = outer_lo, outer_hi
            level >>= 1


def _group_sum(comm: MPI.Comm, rank: int, values: np.ndarray, level: int) -> Any:
    """Sum ``values`` over the 2*level ranks that share rank // (2*level), by
    recursive doubling (partners rank ^ 1, ^ 2, ..., ^ level)."""
    received = np.empty_like(values)
    step = 1
    while step <= level:
        _exchange(comm, values, received, rank ^ step, _TAG_DOTS)
        values = values + received
        step <<= 1
    return values


def _exchange(comm: MPI.Comm, send: np.ndarray, recv: np.ndarray, partner: int,
              tag: int) -> None:
    """MPI_Sendrecv with one partner, waited on in waits.wait_all."""
    wait_all([comm.Irecv(recv, source=partner, tag=tag),
              comm.Isend(send, dest=partner, tag=tag)])


def _moved(itemsize: int, ranges: list[tuple[int, int]]) -> int:
    """Bytes this rank sends (and, symmetrically, receives) in one Adasum allreduce,
    from the ranges it held before each level: at each level it sends one half of
    its range and receives the other (halving), sums three float64 partials with
    partners rank ^ 1, ^ 2, ..., ^ level, and in the allgather sends the half it
    kept and receives the half it gave away."""
    moved, level = 0, 1
    for lo, hi in ranges[:-1]:
        moved += (hi - lo) * itemsize + 3 * 8 * level.bit_length()
        level <<= 1
    return moved
