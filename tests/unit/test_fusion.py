"""Fusion planning and buffers, without MPI: which agreed allreduces share one
reduction (the key), how big a group may grow, and where each tensor sits."""
from __future__ import annotations

import os

import numpy as np
import pytest

from hvdlite.engine import fusion
from hvdlite.negotiation.requests import Descriptor, Kind, ReduceOp, Response


def _response(name: str, count: int = 10, dtype: str = "float32", joined: tuple = (),
              **fields: object) -> Response:
    desc = Descriptor(name=name, kind=Kind.ALLREDUCE, dtype=dtype, shape=(count,),
                      **fields)  # type: ignore[arg-type]
    return Response(desc=desc, joined=joined)


def _names(groups: list) -> list:
    return [[r.name for r in group] for group in groups]


def test_offsets_are_the_running_sum() -> None:
    assert fusion.offsets([3, 0, 2, 5]) == [0, 3, 3, 5]
    assert fusion.offsets([7]) == [0]
    assert fusion.offsets([]) == []


@pytest.mark.parametrize("field,value", [
    ("prescale", 5.0), ("postscale", 3.0), ("op", int(ReduceOp.MAX)), ("device", "cuda:0"),
    ("dtype", "float64")])
def test_key_separates_every_field_of_the_reduction(field: str, value: object) -> None:
    plain, other = _response("a"), _response("b", **{field: value})
    assert fusion.fusion_key(plain) != fusion.fusion_key(other)
    assert fusion.fusion_key(plain) == fusion.fusion_key(_response("c"))
    groups = fusion.plan_groups([plain, other, _response("c")], threshold=1 << 20)
    assert _names(groups) == [["a", "c"], ["b"]]


def test_key_separates_responses_with_different_joined_ranks() -> None:
    groups = fusion.plan_groups([_response("a"), _response("b", joined=(1,)), _response("c")],
                                threshold=1 << 20)
    assert _names(groups) == [["a", "c"], ["b"]]


def test_threshold_is_inclusive_and_a_full_group_is_followed_by_a_fresh_one() -> None:
    responses = [_response(n) for n in "abcde"]          # 40 bytes each
    assert _names(fusion.plan_groups(responses, threshold=80)) == [["a", "b"], ["c", "d"], ["e"]]
    assert _names(fusion.plan_groups(responses, threshold=79)) == [[n] for n in "abcde"]
    assert _names(fusion.plan_groups(responses, threshold=200)) == [list("abcde")]


def test_groups_keep_the_agreed_order() -> None:
    responses = [_response("a"), _response("x", dtype="float64"), _response("b"),
                 _response("y", dtype="float64"), _response("c", 30)]
    assert _names(fusion.plan_groups(responses, threshold=160)) == [
        ["a", "b"], ["x", "y"], ["c"]]         # c (120 bytes) no longer fits a, b's group


def test_large_tensors_in_their_reduction_dtype_are_reduced_alone() -> None:
    big = _response("big", 256)                            # 1024 bytes
    small = [_response("s1", 4), _response("s2", 4)]
    groups = fusion.plan_groups([small[0], big, small[1]], threshold=1 << 20, direct_bytes=1024)
    assert _names(groups) == [["s1", "s2"], ["big"]]
    groups = fusion.plan_groups([small[0], big, small[1]], threshold=1 << 20, direct_bytes=1025)
    assert _names(groups) == [["s1", "big", "s2"]]
    groups = fusion.plan_groups([small[0], big, small[1]], threshold=1 << 20, direct_bytes=512)
    assert _names(groups) == [["s1", "s2"], ["big"]]         # larger than the bound: alone too
    # A half tensor is widened on the way in: never reduced in its own memory.
    halves = [_response("h1", 512, "float16"), _response("h2", 4, "float16")]
    assert _names(fusion.plan_groups(halves, threshold=1 << 20, direct_bytes=1024)) == [
        ["h1", "h2"]]


def test_adasum_tensors_are_never_fused_and_one_response_is_one_group() -> None:
    adasum = [_response(n, op=int(ReduceOp.ADASUM)) for n in "ab"]
    assert _names(fusion.plan_groups(adasum, threshold=1 << 20)) == [["a"], ["b"]]
    lone = _response("lone", 1 << 20)
    assert _names(fusion.plan_groups([lone], threshold=8)) == [["lone"]]
    assert fusion.plan_groups([], threshold=8) == []


def test_reduction_dtype_decides_the_bytes_counted() -> None:
    responses = [_response("a", 10, "float16"), _response("b", 10, "float16")]
    as_is = fusion.plan_groups(responses, 40, reduced_dtype=lambda r: r.dtype)
    assert _names(as_is) == [["a", "b"]]                    # 2 x 20 bytes natively
    assert _names(fusion.plan_groups(responses, 40)) == [["a"], ["b"]]   # 2 x 40 widened


def test_buffers_grow_per_device_and_view_the_requested_dtype() -> None:
    made = []

    def xp_for(device: str) -> object:
        made.append(device)
        return np
    buffers = fusion.FusionBuffers(xp_for)
    small = buffers.view("cpu", np.dtype(np.float32), 4)
    assert small.dtype == np.float32 and small.shape == (4,) and not small.any()
    same = buffers.view("cpu", np.dtype(np.float64), 2)      # fits: no new allocation
    assert np.shares_memory(small, same) and buffers.host_bytes == 16
    grown = buffers.view("cpu", np.dtype(np.float64), 3)
    assert grown.shape == (3,) and not np.shares_memory(small, grown)
    assert buffers.host_bytes == 24 and made == []           # the host's is a map of its own
    other = buffers.view("cuda:0", np.dtype(np.int8), 5)
    assert not np.shares_memory(other, grown) and made == ["cuda:0"]
    assert not buffers.view("cpu", np.dtype(np.float32), 0).size


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads Linux's /proc")
def test_the_host_buffer_is_resident_when_made_and_gone_when_released() -> None:
    """Pre-faulted, so a step never page-faults it; released, its memory goes back
    to the system (a malloc'ed buffer of this size would stay in malloc's heap)."""
    nbytes = 64 << 20
    buffers = fusion.FusionBuffers(lambda device: np)
    before = _resident_bytes()
    view = buffers.view("cpu", np.dtype(np.float32), nbytes // 4)
    made = _resident_bytes()
    assert made - before > nbytes * 3 // 4
    del view
    buffers.release_host()
    assert buffers.host_bytes == 0
    assert made - _resident_bytes() > nbytes * 3 // 4


def test_a_view_in_use_outlives_the_release() -> None:
    buffers = fusion.FusionBuffers(lambda device: np)
    in_use = buffers.view("cpu", np.dtype(np.int64), 4)
    in_use[:] = [1, 2, 3, 4]
    buffers.release_host()            # (from another thread while the engine reduces)
    fresh = buffers.view("cpu", np.dtype(np.int64), 4)
    fresh[:] = 0
    assert in_use.tolist() == [1, 2, 3, 4] and not np.shares_memory(in_use, fresh)


def test_min_max_product_tensors_are_fused_like_sums() -> None:
    for op in (ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT, ReduceOp.AVERAGE):
        responses = [_response(n, op=int(op)) for n in "ab"]
        assert _names(fusion.plan_groups(responses, threshold=1 << 20)) == [["a", "b"]], op


def test_default_direct_bound_is_the_configured_default() -> None:
    from hvdlite.config import Config
    assert fusion.DEFAULT_DIRECT_BYTES == Config().direct_threshold == 1 << 20
    at, below = _response("at", (1 << 20) // 4), _response("below", (1 << 20) // 4 - 1)
    small = _response("small", 4)
    assert _names(fusion.plan_groups([small, at], threshold=1 << 30)) == [["small"], ["at"]]
    assert _names(fusion.plan_groups([small, below], threshold=1 << 30)) == [["small", "below"]]


def test_a_smaller_view_reuses_the_buffer() -> None:
    buffers = fusion.FusionBuffers(lambda device: np)
    large = buffers.view("cpu", np.dtype(np.float64), 8)
    smaller = buffers.view("cpu", np.dtype(np.float32), 3)
    assert np.shares_memory(large, smaller) and smaller.shape == (3,)
