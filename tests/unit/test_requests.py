"""What a rank submits and what ranks agree on, without MPI: dtype names that
travel in descriptors, a descriptor's defaults, and a response's derived facts."""
from __future__ import annotations

import pickle
import time

import ml_dtypes
import numpy as np
import pytest

from hvdlite.negotiation.cache import ResponseCache
from hvdlite.negotiation.requests import (CACHEABLE, Descriptor, Kind, ReduceOp, Request, Response,
                                          dtype_name, to_dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.dtype("int64"), np.float16, np.bool_,
                                   np.uint8, ml_dtypes.bfloat16, np.dtype(ml_dtypes.bfloat16)])
def test_dtype_names_round_trip(dtype: object) -> None:
    name = dtype_name(dtype)  # type: ignore[arg-type]
    assert isinstance(name, str)
    assert to_dtype(name) == np.dtype(dtype)  # type: ignore[call-overload]


def test_bfloat16_has_a_name_numpy_does_not_know() -> None:
    assert dtype_name(ml_dtypes.bfloat16) == "bfloat16"
    assert to_dtype("bfloat16") == np.dtype(ml_dtypes.bfloat16)
    assert to_dtype("float32") == np.dtype(np.float32)
    with pytest.raises(TypeError):
        to_dtype("float33")


def test_a_descriptor_defaults_to_an_unscaled_sum_on_the_cpu() -> None:
    desc = Descriptor(name="t", kind=Kind.ALLREDUCE)
    assert (desc.op, desc.prescale, desc.postscale) == (int(ReduceOp.SUM), 1.0, 1.0)
    assert (desc.dtype, desc.shape, desc.device, desc.root, desc.set_id) == ("", (), "cpu", -1, -1)
    assert (desc.splits, desc.ranks, desc.thread, desc.settings, desc.error) == (
        None, None, "", (), "")
    assert pickle.loads(pickle.dumps(desc)) == desc


def test_only_the_collectives_are_cacheable() -> None:
    assert CACHEABLE == {Kind.ALLREDUCE, Kind.ALLGATHER, Kind.BROADCAST, Kind.ALLTOALL,
                         Kind.REDUCESCATTER}


def test_a_new_request_is_unassigned_and_stamped_now() -> None:
    before = time.monotonic()
    request = Request(Descriptor(name="t", kind=Kind.ALLREDUCE), 2)
    after = time.monotonic()
    assert before <= request.submitted_at <= after
    assert request.process_set_id == 2 and request.array is None and request.output is None
    assert (request.handle, request.bit, request.agreed_at) == (-1, None, 0.0)
    assert request.stall_reported is False
    assert request.writeback is None and request.ready is None


@pytest.mark.parametrize("shape,count", [((), 1), ((3,), 3), ((2, 0, 5), 0), ((2, 3, 4), 24),
                                         ((1 << 20, 1 << 12), 1 << 32)])
def test_a_response_knows_its_name_dtype_and_element_count(shape: tuple, count: int) -> None:
    response = Response(Descriptor(name="grad", kind=Kind.ALLREDUCE, dtype="bfloat16",
                                   shape=shape))
    assert response.name == "grad"
    assert response.dtype == np.dtype(ml_dtypes.bfloat16)
    assert response.count == count and type(response.count) is int


def test_a_new_request_finds_its_cached_response_whatever_the_cache_version() -> None:
    cache = ResponseCache(capacity=8)
    wanted = Descriptor(name="t", kind=Kind.ALLREDUCE, dtype="float32", shape=(4,))
    assert cache.bit_for(Request(wanted, 0)) is None
    cache.insert(Response(wanted), wanted)
    for other in range(4):                          # each insert changes the cache's version
        bit = cache.lookup(wanted)
        assert bit is not None and cache.bit_for(Request(wanted, 0)) == bit
        extra = wanted._replace(name=f"other{other}")
        cache.insert(Response(extra), extra)
