"""A differential test of every collective against a NumPy reference, on any path.

A *path* is a binding's ops (``make_ops`` of an adapter) and the two conversions
between NumPy arrays and its tensors: host NumPy over MPI, the ring or the
parameter server; torch tensors; CUDA tensors over NCCL or staged through the
host; the CPU stand-in for CuPy and NCCL (tests/standin). ``run_cases`` puts the
same seeded cases through a path and returns what differed.

A case is one call: a collective (allreduce, in place or not, grouped, allgather,
broadcast, alltoall, reducescatter), a dtype, a size drawn from awkward ones (0, 1,
primes, 2^k +/- 1, above the fusion threshold the caller sets), an op (Sum,
Average, Min, Max, Product, Adasum), prescale and postscale factors, and the
global set or a process set. Every rank builds every rank's input from (seed,
case, rank), so each rank computes the whole reference itself. Values are small
integers, so sums, products and power-of-two scalings are exact in every dtype
and every order of reduction; Average and Adasum are compared within a few ulps.
Inputs the API must refuse (bool reductions, Min of complex, Adasum off the
host...) are cases too: every rank must raise an HvdliteError.

A failure names the case and gives a one-line reproduction: the environment
variables DIFFERENTIAL_SEED and DIFFERENTIAL_CASE select the seed and one case.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any, Callable, Iterator, Optional, Sequence

import ml_dtypes
import numpy as np

import hvdlite as hvd
from hvdlite.api import runtime
from hvdlite.api.control import reconfigure

SEED = int(os.environ.get("DIFFERENTIAL_SEED", "20261126"))
ONLY = os.environ.get("DIFFERENTIAL_CASE")
BF16 = np.dtype(ml_dtypes.bfloat16)
FLOATS = ("float16", "bfloat16", "float32", "float64")
INTS = ("int8", "uint8", "int16", "int32", "int64")
DTYPES = FLOATS + INTS + ("complex64", "bool")
OPS = ("Sum", "Average", "Min", "Max", "Product", "Adasum")
# 0, 1, primes, 2^k - 1 and 2^k + 1, 17^3 (Horovod's 3-d test tensor), and the length
# at which NCCL 2.28's ncclAvg left its last 3 elements unwritten.
SIZES = (0, 1, 2, 3, 5, 7, 13, 15, 16, 17, 31, 33, 127, 257, 1021, 1023, 1025, 4093, 4913,
         8191, 65535, 65537)
LARGE = 1_048_579
KINDS = ("allreduce", "allreduce_", "grouped_allreduce", "allgather", "broadcast",
         "broadcast_", "alltoall", "reducescatter")
SCALES = (1.0, 1.0, 0.5, 2.0)      # powers of two: exact in every dtype
# Thresholds small enough that fusion, direct reduction and the ring's chunking are
# reached by small tensors: "above the fusion threshold" costs little.
SMALL = {"fusion_threshold": 16 << 10, "direct_threshold": 8 << 10, "ring_threshold": 4 << 10,
         "ring_chunk": 1 << 10}


@contextlib.contextmanager
def even_ranks_and_small_thresholds() -> Iterator[Any]:
    """The process set of the even ranks (one rank at -n 2; the global set at -n 1,
    since the world cannot be added again), with SMALL thresholds, undone after."""
    previous = {key: getattr(runtime.config(), key) for key in SMALL}
    reconfigure(**SMALL)
    evens = [r for r in range(hvd.size()) if r % 2 == 0]
    subset = hvd.add_process_set(evens) if hvd.size() > 1 else hvd.global_process_set
    try:
        yield subset
    finally:
        if subset is not hvd.global_process_set:
            hvd.remove_process_set(subset)
        reconfigure(**previous)


@dataclasses.dataclass(frozen=True)
class Case:
    index: int
    kind: str
    dtype: str
    n: int
    op: str
    prescale: float
    postscale: float
    subset: bool        # on the process set of the even ranks, not the global set

    def describe(self) -> str:
        scaled = f" prescale={self.prescale} postscale={self.postscale}" if self.op else ""
        where = " on the even ranks' process set" if self.subset else ""
        return f"case {self.index}: {self.kind} {self.dtype}[{self.n}] {self.op}{scaled}{where}"


def cases(count: int, large: bool = True, seed: int = SEED) -> list[Case]:
    """``count`` cases drawn from ``seed`` (the same on every rank)."""
    rng = np.random.default_rng(seed)
    drawn = []
    for index in range(count):
        kind = str(rng.choice(KINDS))
        reduces = kind in ("allreduce", "allreduce_", "grouped_allreduce", "reducescatter")
        n = int(rng.choice(SIZES)) if rng.random() < 0.8 else int(rng.integers(0, 70000))
        if large and rng.random() < 0.02:
            n = LARGE
        op = str(rng.choice(OPS[:-1] if kind == "reducescatter" else OPS)) if reduces else ""
        scales = (float(rng.choice(SCALES)), float(rng.choice(SCALES)))
        if op in ("", "Product", "Adasum"):      # a scaled product would overflow int8
            scales = (1.0, 1.0)
        drawn.append(Case(index, kind, str(rng.choice(DTYPES)), n, op, *scales,
                          subset=bool(rng.random() < 0.15)))
    if ONLY is not None:
        drawn = [c for c in drawn if c.index == int(ONLY)]
    return drawn


def dtype_of(name: str) -> np.dtype:
    return BF16 if name == "bfloat16" else np.dtype(name)


def values(case: Case, rank: int, count: int, salt: int = 0) -> np.ndarray:
    """Rank ``rank``'s input of ``count`` elements: small integers (1 and 2 for Product,
    so a product over 4 ranks stays exact)."""
    rng = np.random.default_rng((SEED, case.index, rank, salt))
    if case.op == "Product":
        raw = rng.integers(1, 3, count)
    elif case.dtype == "uint8" or case.dtype == "bool":
        raw = rng.integers(0, 4, count)
    else:
        raw = rng.integers(-3, 4, count)
    return raw.astype(dtype_of(case.dtype))


@dataclasses.dataclass
class Path:
    """How a binding's tensors are made and read back."""
    name: str
    ops: dict[str, Callable[..., Any]]
    to_tensor: Callable[[np.ndarray], Any]
    to_numpy: Callable[[Any], np.ndarray]
    host: bool = True          # Adasum runs on host tensors only


def expected_error(case: Case, path: Path, set_size: int) -> bool:
    """Whether the API must refuse this case (on every rank)."""
    if not case.op:
        return False
    if case.dtype == "bool" or case.dtype == "complex64" and case.op in ("Min", "Max"):
        return True
    if case.op == "Adasum":
        return (case.dtype not in FLOATS or not path.host or set_size & (set_size - 1) != 0
                or case.kind == "grouped_allreduce")
    return False


# -- the reference ---------------------------------------------------------------------

def _scaled(array: np.ndarray, factor: float, dtype: np.dtype) -> np.ndarray:
    """Scaling as hvdlite documents it: integers in float64, truncated toward zero."""
    if factor == 1.0:
        return array
    return np.trunc(array * factor) if dtype.kind in "iu" else array * factor


def _adasum(vectors: list[np.ndarray]) -> np.ndarray:
    """The binary tree of pairwise Adasum over ranks 0..P-1 (hvdlite.backends.adasum)."""
    while len(vectors) > 1:
        paired = []
        for a, b in zip(vectors[::2], vectors[1::2]):
            dot, aa, bb = float(a @ b), float(a @ a), float(b @ b)
            ca = 1.0 - dot / (2 * aa) if aa else 1.0
            cb = 1.0 - dot / (2 * bb) if bb else 1.0
            paired.append(ca * a + cb * b)
        vectors = paired
    return vectors[0]


def reduced(case: Case, inputs: list[np.ndarray]) -> np.ndarray:
    """The reduction of every member's input, in float64 (complex128), before the cast."""
    dtype = dtype_of(case.dtype)
    wide = np.complex128 if dtype.kind == "c" else np.float64
    stack = [_scaled(x.astype(wide), case.prescale, dtype) for x in inputs]
    if case.op == "Adasum":
        total = _adasum(stack) if dtype.kind == "f" or dtype == BF16 else stack[0]  # refused
    else:
        how = {"Sum": np.sum, "Average": np.sum, "Min": np.min, "Max": np.max,
               "Product": np.prod}[case.op]
        total = how(np.stack(stack), axis=0)
    if case.op == "Average":
        total = total / len(inputs)
        total = np.trunc(total) if dtype.kind in "iu" else total
    return _scaled(total, case.postscale, dtype)


def close(case: Case, got: np.ndarray, want: np.ndarray) -> bool:
    """Exact, except where rounding is allowed: Average's division and Adasum."""
    dtype = dtype_of(case.dtype)
    if got.shape != want.shape or got.dtype != dtype:
        return False
    exact = want.astype(dtype)
    if dtype.kind in "iub" or case.op not in ("Average", "Adasum"):
        return bool(np.array_equal(got, exact))
    eps = float(ml_dtypes.finfo(dtype).eps) if dtype == BF16 else float(np.finfo(dtype).eps)
    tolerance = (64 if case.op == "Adasum" else 2) * eps
    wide = np.complex128 if dtype.kind == "c" else np.float64
    return bool(np.allclose(got.astype(wide), want.astype(wide), rtol=tolerance, atol=tolerance))


# -- running a case ----------------------------------------------------------------------

GROUP = (17, 4913, 3, 1001)     # the grouped sizes whose Average came back wrong on a GPU


def _shape(case: Case) -> tuple[int, ...]:
    """Rows of 3 where a collective splits by rows (allgather, alltoall,
    reducescatter), so row offsets are exercised; flat elsewhere."""
    if case.kind in ("allgather", "alltoall", "reducescatter"):
        return (case.n // 3, 3) if case.n >= 3 else (case.n, 1)
    return (case.n,)


def _rows(case: Case, rank: int, peer: int) -> int:
    """Rows ``rank`` gives (allgather: peer ignored) or sends to ``peer`` (alltoall)."""
    return (case.index + 2 * rank + peer) % 3


def _reduction_kwargs(case: Case) -> dict[str, Any]:
    return {"op": getattr(hvd, case.op), "prescale_factor": case.prescale,
            "postscale_factor": case.postscale}


def _call(case: Case, path: Path, me: int, members: Sequence[int], process_set: Any
          ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Run the case on this rank: (what it returned, what the reference says)."""
    ops, name = path.ops, f"diff.{path.name}.{case.index}"
    rank_of = {g: i for i, g in enumerate(members)}
    shape = _shape(case)
    count = int(np.prod(shape))
    if case.kind in ("allreduce", "allreduce_", "reducescatter"):
        inputs = [values(case, g, count).reshape(shape) for g in members]
        tensor = path.to_tensor(inputs[rank_of[me]])
        total = reduced(case, [x.reshape(-1) for x in inputs]).reshape(shape)
        if case.kind == "reducescatter":
            got = ops["reducescatter"](tensor, name=name, process_set=process_set,
                                       **_reduction_kwargs(case))
            base, extra = divmod(shape[0], len(members))     # the first ranks one row more
            counts = [base + (i < extra) for i in range(len(members))]
            start = sum(counts[:rank_of[me]])
            return [path.to_numpy(got)], [total[start:start + counts[rank_of[me]]]]
        call = ops["allreduce_" if case.kind == "allreduce_" else "allreduce"]
        got = call(tensor, name=name, process_set=process_set, **_reduction_kwargs(case))
        if case.kind == "allreduce_":
            got = tensor            # the result is the tensor itself
        return [path.to_numpy(got)], [total]
    if case.kind == "grouped_allreduce":
        sizes = [max(1, case.n % 5000)] + list(GROUP)
        inputs = [[values(case, g, n, salt) for g in members] for salt, n in enumerate(sizes)]
        tensors = [path.to_tensor(per_rank[rank_of[me]]) for per_rank in inputs]
        got = ops["grouped_allreduce"](tensors, name=name, process_set=process_set,
                                       **_reduction_kwargs(case))
        return [path.to_numpy(t) for t in got], [reduced(case, per_rank) for per_rank in inputs]
    if case.kind == "allgather":
        cols = shape[1]
        pieces = [values(case, g, _rows(case, g, 0) * cols).reshape(-1, cols) for g in members]
        got = ops["allgather"](path.to_tensor(pieces[rank_of[me]]), name=name,
                               process_set=process_set)
        return [path.to_numpy(got)], [np.concatenate(pieces)]
    if case.kind in ("broadcast", "broadcast_"):
        root = members[case.index % len(members)]
        tensor = path.to_tensor(values(case, me, count))
        got = ops[case.kind](tensor, root, name=name, process_set=process_set)
        got = tensor if case.kind == "broadcast_" else got
        return [path.to_numpy(got)], [values(case, root, count)]
    return _alltoall(case, path, me, members, process_set, name)


def _alltoall(case: Case, path: Path, me: int, members: Sequence[int], process_set: Any,
              name: str) -> tuple[list[np.ndarray], list[np.ndarray]]:
    cols = _shape(case)[1]

    def sent(g: int) -> tuple[np.ndarray, list[int]]:
        splits = [_rows(case, g, p) for p in range(len(members))]
        return values(case, g, sum(splits) * cols).reshape(-1, cols), splits
    data, splits = sent(me)
    got, _ = path.ops["alltoall"](path.to_tensor(data), splits=splits, name=name,
                                  process_set=process_set)   # (rows, rows per sender)
    position = list(members).index(me)
    pieces = []
    for g in members:
        their_data, their_splits = sent(g)
        start = sum(their_splits[:position])
        pieces.append(their_data[start:start + their_splits[position]])
    return [path.to_numpy(got)], [np.concatenate(pieces)]


def run_case(case: Case, path: Path, members: Sequence[int], process_set: Any
             ) -> Optional[str]:
    """None if this rank's result matches the reference (or the refusal the API
    owes), else what differed."""
    me = hvd.rank()
    refused = expected_error(case, path, len(members))
    try:
        got, want = _call(case, path, me, members, process_set)
    except hvd.HvdliteError as error:
        return None if refused else f"raised {type(error).__name__}: {str(error)[:200]}"
    if refused:
        return "returned a result where hvdlite must refuse the call"
    for index, (g, w) in enumerate(zip(got, want)):
        if not close(case, g, w):
            where = _first_difference(g, w.astype(g.dtype) if g.shape == w.shape else w)
            return f"output {index}: {where}"
    return None


def _first_difference(got: np.ndarray, want: np.ndarray) -> str:
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"shape/dtype {got.shape} {got.dtype}, expected {want.shape} {want.dtype}"
    flat_got, flat_want = got.reshape(-1), want.reshape(-1)
    wrong = np.flatnonzero(~np.isclose(flat_got.astype(np.complex128),
                                       flat_want.astype(np.complex128)))
    first = int(wrong[0]) if wrong.size else 0
    return (f"{wrong.size} of {flat_got.size} elements differ, first at {first}: "
            f"got {flat_got[first]!r}, expected {flat_want[first]!r}")


def run_cases(path: Path, drawn: Sequence[Case], subset: Any, reproduce: str) -> list[str]:
    """Every case through ``path`` on this rank; the lines describing what differed.
    ``subset`` is the registered process set of the even ranks; ``reproduce`` the
    command that reruns this path (a case's variables are put before it)."""
    everyone = list(range(hvd.size()))
    failures = []
    for case in drawn:
        members = subset.ranks if case.subset else everyone
        if hvd.rank() not in members:
            continue
        problem = run_case(case, path, members, subset if case.subset else None)
        if problem is not None:
            failures.append(f"rank {hvd.rank()}, {path.name}, {case.describe()}: {problem}\n"
                            f"    reproduce: DIFFERENTIAL_SEED={SEED} "
                            f"DIFFERENTIAL_CASE={case.index} {reproduce}")
    return failures
