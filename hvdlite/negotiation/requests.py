"""What a rank submits (Request, with its picklable Descriptor) and what the
ranks agree to run (Response)."""
from __future__ import annotations

import dataclasses
import enum
import functools
import time
from typing import Any, NamedTuple, Optional

import ml_dtypes
import numpy as np

from hvdlite.errors import ErrorKind
from hvdlite.reduce_op import ReduceOp

__all__ = ["ReduceOp", "dtype_name", "to_dtype", "Kind", "Descriptor", "Request", "Response", "CACHEABLE"]


_NAMED_DTYPES = {"bfloat16": np.dtype(ml_dtypes.bfloat16)}


@functools.lru_cache(maxsize=None)
def dtype_name(dtype: np.dtype) -> str:
    """A name that travels in descriptors and round-trips through ``to_dtype``."""
    return np.dtype(dtype).name


def to_dtype(name: str) -> np.dtype:
    return _NAMED_DTYPES.get(name) or np.dtype(name)


class Kind(enum.Enum):
    ALLREDUCE = "allreduce"
    ALLGATHER = "allgather"
    BROADCAST = "broadcast"
    ALLTOALL = "alltoall"
    REDUCESCATTER = "reducescatter"
    BARRIER = "barrier"
    JOIN = "join"
    ADD_PROCESS_SET = "add_process_set"
    REMOVE_PROCESS_SET = "remove_process_set"
    RECONFIGURE = "reconfigure"
    OPEN_LANE = "open_lane"          # agreed buckets' lane (hvdlite/engine/lane.py)


# Kinds whose agreed responses are worth remembering for the bit-vector fast path.
CACHEABLE = frozenset({Kind.ALLREDUCE, Kind.ALLGATHER, Kind.BROADCAST, Kind.ALLTOALL,
                       Kind.REDUCESCATTER})


class Descriptor(NamedTuple):
    """Everything about a submitted tensor that ranks must agree on.

    Small and picklable: this is what travels in a full negotiation round, and
    equality of descriptors is what a response-cache hit means. A NamedTuple:
    one is built per submitted tensor, and a frozen dataclass cost 5x more.
    """
    name: str
    kind: Kind
    dtype: str = ""
    shape: tuple[int, ...] = ()
    op: int = int(ReduceOp.SUM)
    root: int = -1
    prescale: float = 1.0
    postscale: float = 1.0
    splits: Optional[tuple[int, ...]] = None
    ranks: Optional[tuple[int, ...]] = None  # process-set membership for ADD_PROCESS_SET
    device: str = "cpu"          # "cpu" or "cuda:N": compared across ranks, part of the fusion key
    set_id: int = -1             # REMOVE_PROCESS_SET: the set to remove
    thread: str = ""             # unnamed ops: the submitting thread (see runtime.next_name)
    settings: tuple = ()         # RECONFIGURE: sorted (field, value) pairs; OPEN_LANE: its kind
    error: str = ""              # a marker: this rank's arguments were invalid (the reason)
    parts: tuple = ()            # a bundled grouped allreduce: each tensor's shape, in order


class Request:
    """One rank's submission: the descriptor plus the buffers and bookkeeping."""
    __slots__ = ("desc", "process_set_id", "array", "output", "writeback", "ready",
                 "submitted_at", "agreed_at", "stall_reported", "handle", "bit", "bit_version")

    def __init__(self, desc: Descriptor, process_set_id: int,
                 array: Optional[np.ndarray] = None, output: Optional[np.ndarray] = None) -> None:
        self.desc = desc
        self.process_set_id = process_set_id
        self.array = array            # contiguous input
        self.output = output          # where results land (the user's array for in-place ops)
        # In-place ops on a non-contiguous target: results land in the contiguous
        # ``output`` first and are copied here on completion, whatever the strides.
        self.writeback: Any = None
        # GPU tensors: an event recorded on the framework's stream at submission; the
        # engine's stream waits on it before reading the tensor (None on the CPU).
        self.ready: Any = None
        self.submitted_at = time.monotonic()
        self.agreed_at = 0.0
        self.stall_reported = False
        self.handle = -1              # assigned by Engine.submit; stays -1 for error markers
        self.bit: Optional[int] = None   # cache bit, valid while bit_version matches the cache
        self.bit_version = -1


@dataclasses.dataclass
class Response:
    """A collective every member rank runs, in the same order everywhere.

    ``desc`` is the coordinator's view. ``first_dims`` (allgather) and
    ``split_matrix`` (alltoall, row = sender) carry what differs per rank.
    ``joined`` lists ranks that called join() and contribute the op's identity.
    """
    desc: Descriptor
    first_dims: Optional[tuple[int, ...]] = None
    split_matrix: Optional[tuple[tuple[int, ...], ...]] = None
    joined: tuple[int, ...] = ()
    error: str = ""
    error_kind: Optional[ErrorKind] = None
    result: Any = None   # JOIN: the last rank to join

    def __post_init__(self) -> None:
        self.name = self.desc.name   # read many times per step: a field, not a property

    # Facts derived once per response: a cached response is reused every step.
    @functools.cached_property
    def dtype(self) -> np.dtype:
        return to_dtype(self.desc.dtype)

    @functools.cached_property
    def count(self) -> int:
        return int(np.prod(self.desc.shape, dtype=np.int64))
