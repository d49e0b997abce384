"""The staged GPU backend (hvdlite/backends/staged.py: copies through pinned host
memory around the host backends) without a GPU, over tests/unit/gpu_ranks.py;
its allgather, alltoall and reducescatter are in test_gpu_backends.py, beside
NCCL's."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from hvdlite.reduce_op import ReduceOp
from tests.unit import fake_cupy
from tests.unit.fake_comm import ThreadComm
from tests.unit.gpu_ranks import (BF16, ELEMENTWISE, F16, F32, SET, SIZES, config,
                                  contribution, on_gpus, opened, reduced,
                                  widened_size)


# --- staged.py: through pinned host memory ----------------------------------------------

def test_staged_supports_every_elementwise_op_on_gpus_in_widened_dtypes(
        gpu: SimpleNamespace) -> None:
    backend = gpu.staged.StagedBackend(config())
    for op in ELEMENTWISE:
        assert backend.supports("allreduce", F32, "cuda:2", 8, op)
    assert not backend.supports("allreduce", F32, "cuda:0", 8, ReduceOp.ADASUM)
    assert not backend.supports("allreduce", F32, "cpu", 8)
    assert backend.reduction_dtype(F16) == F32 and backend.reduction_dtype(BF16) == F32
    assert backend.reduction_dtype(np.dtype(np.int8)) == np.dtype(np.int8)
    nccl = gpu.nccl.NcclBackend(config())
    assert nccl.traffic is nccl._staged.traffic and nccl.traffic.exact is False


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("host", ["mpi", "ring"])
@pytest.mark.parametrize("dtype", [F32, F16, BF16, np.dtype(np.int32), np.dtype(np.uint8)],
                         ids=str)
def test_staged_allreduce_each_op(gpu: SimpleNamespace, size: int, host: str,
                                  dtype: np.dtype) -> None:
    n = 7

    def work(comm: ThreadComm) -> Any:
        backend = opened(gpu.staged.StagedBackend, comm, allreduce=host, ring_chunk=64)
        results = []
        for op in ELEMENTWISE:
            buf = gpu.cupy.asarray(contribution(comm.rank, n, dtype, op))
            assert backend.allreduce(SET, buf, op).done()
            results.append(buf.get())
        return results, backend.traffic.snapshot()["allreduce"]
    for results, traffic in on_gpus(size, work):
        for op, result in zip(ELEMENTWISE, results):
            np.testing.assert_array_equal(result, reduced(size, n, dtype, op), str(op))
        estimate = 2 * n * widened_size(dtype) * (size - 1) // size
        if host == "mpi":
            assert traffic == {"calls": 5, "sent": 5 * estimate, "received": 5 * estimate}


def rounding_contribution(rank: int, dtype: np.dtype) -> np.ndarray:
    """2^k + 1 + 1 ...: a sum that a half type rounds at every step (2^k + 1 is a tie
    rounded down to 2^k) but float32 holds exactly."""
    big = 2048 if dtype == F16 else 256
    return np.array([big if rank == 0 else 1, 1], dtype=dtype)


@pytest.mark.parametrize("size", [3, 4])
@pytest.mark.parametrize("dtype", [F16, BF16], ids=str)
def test_staged_reductions_of_half_types_run_in_float32(gpu: SimpleNamespace, size: int,
                                                        dtype: np.dtype) -> None:
    stack = [rounding_contribution(r, dtype) for r in range(size)]
    exact = np.sum([s.astype(F32) for s in stack], axis=0).astype(dtype)
    stepwise = stack[0].copy()
    for part in stack[1:]:
        stepwise += part
    assert exact[0] != stepwise[0]           # the data can tell the two apart

    def work(comm: ThreadComm) -> Any:
        backend = opened(gpu.staged.StagedBackend, comm, allreduce="mpi")
        buf = gpu.cupy.asarray(rounding_contribution(comm.rank, dtype))
        backend.allreduce(SET, buf, ReduceOp.SUM)
        whole = np.concatenate([rounding_contribution(comm.rank, dtype)] * size)
        scattered, out = gpu.cupy.asarray(whole), gpu.cupy.empty(2, dtype)
        backend.reducescatter(SET, scattered, [2] * size, out, ReduceOp.SUM)
        return buf.get(), out.get()
    for allreduced, scattered in on_gpus(size, work):
        np.testing.assert_array_equal(allreduced, exact)
        np.testing.assert_array_equal(scattered, exact)


@pytest.mark.parametrize("size", [2, 3])
def test_staged_allreduce_uses_the_ring_from_the_threshold(gpu: SimpleNamespace,
                                                           size: int) -> None:
    """HVDLITE_ALLREDUCE=auto: the ring (point-to-point messages) from
    ring_threshold bytes of the *widened* buffer, MPI's Allreduce below it."""
    def work(comm: ThreadComm) -> list[int]:
        backend = opened(gpu.staged.StagedBackend, comm, allreduce="auto", ring_threshold=64)
        messages = []
        for n, dtype in ((16, F32), (15, F32), (16, F16), (8, np.dtype(np.float64)),
                         (40, F32)):
            comm.allgather(None)            # every rank's earlier sends are counted
            before = comm.world.messages
            comm.allgather(None)            # and no rank sends before all have read
            backend.allreduce(SET, gpu.cupy.asarray(contribution(comm.rank, n, dtype)),
                              ReduceOp.SUM)
            comm.allgather(None)
            messages.append(comm.world.messages - before)
        return messages
    for messages in on_gpus(size, work):
        assert [m > 0 for m in messages] == [True, False, True, True, True]


def test_staged_settings_mpi_never_uses_the_ring(gpu: SimpleNamespace) -> None:
    def work(comm: ThreadComm) -> int:
        backend = opened(gpu.staged.StagedBackend, comm, allreduce="mpi", ring_threshold=0)
        backend.allreduce(SET, gpu.cupy.asarray(contribution(comm.rank, 64, F32)),
                          ReduceOp.SUM)
        return comm.world.messages
    assert on_gpus(2, work) == [0, 0]


@pytest.mark.parametrize("size", SIZES)
def test_staged_broadcast_from_the_last_rank(gpu: SimpleNamespace, size: int) -> None:
    def work(comm: ThreadComm) -> Any:
        backend = opened(gpu.staged.StagedBackend, comm)
        buf = gpu.cupy.asarray(contribution(comm.rank, 5, np.dtype(np.int16)))
        backend.broadcast(SET, buf, size - 1)
        return buf.get()
    for result in on_gpus(size, work):
        np.testing.assert_array_equal(result, contribution(size - 1, 5, np.dtype(np.int16)))


def test_staged_copies_go_through_pinned_memory_on_the_engine_stream(
        gpu: SimpleNamespace) -> None:
    def work(comm: ThreadComm) -> list[tuple]:
        backend = opened(gpu.staged.StagedBackend, comm)
        backend.allreduce(SET, gpu.cupy.asarray(contribution(comm.rank, 4, F16)), ReduceOp.SUM)
        return gpu.cuda.stream_for(comm.rank).log
    for log in on_gpus(2, work):
        assert log == [("get", 8, True), ("synchronize",), ("set", 8, True)]


def test_pinned_memory_grows_to_the_larger_of_need_and_double(gpu: SimpleNamespace) -> None:
    pinned = gpu.staged._Pinned()
    first = pinned.view(F32, 10)
    first[...] = np.arange(10)
    again = pinned.view(F32, 5)
    assert again.dtype == F32 and again.size == 5
    np.testing.assert_array_equal(again, np.arange(5))        # the same memory
    assert pinned.view(F32, 10).size == 10                     # exactly what exists: kept
    assert fake_cupy.state().pinned == [40]
    assert pinned.view(np.dtype(np.uint8), 4, 40).size == 4     # 44 > 40: doubles, to 80
    grown = pinned.view(F32, 11)
    assert grown.size == 11
    pinned.view(np.dtype(np.uint8), 100, 64)                    # 164 > 2 * 80
    offset = pinned.view(np.dtype(np.int16), 2, 6)
    offset[...] = [7, 9]
    raw = pinned.view(np.dtype(np.uint8), 10)
    assert raw[6:10].view(np.int16).tolist() == [7, 9]
    assert fake_cupy.state().pinned == [40, 80, 164]
    assert all(fake_cupy.is_pinned(a) for a in (first, grown, offset))


@pytest.mark.parametrize("kind", ["allgather", "allreduce"])
def test_a_first_staged_operation_with_nothing_to_send(gpu: SimpleNamespace, kind: str) -> None:
    """Rank 0 has no rows (or an empty tensor) before any pinned memory exists: it
    must still take part, or its peers wait in MPI forever."""
    def work(comm: ThreadComm) -> np.ndarray:
        backend = opened(gpu.staged.StagedBackend, comm)
        mine = np.full(0 if comm.rank == 0 else 3, comm.rank, np.uint8)
        if kind == "allreduce":
            buf = gpu.cupy.asarray(mine[:0])
            backend.allreduce(SET, buf, ReduceOp.SUM)
            return buf.get()
        recv = gpu.cupy.empty(3 * (comm.Get_size() - 1), np.uint8)
        backend.allgather(SET, gpu.cupy.asarray(mine), recv, [0, 3, 3][: comm.Get_size()])
        return recv.get()
    expected = {"allgather": np.repeat(np.arange(1, 3, dtype=np.uint8), 3),
                "allreduce": np.zeros(0, np.uint8)}[kind]
    for result in on_gpus(3, work):
        np.testing.assert_array_equal(result, expected)


def test_the_receive_region_starts_on_the_next_64_byte_boundary(gpu: SimpleNamespace) -> None:
    assert [gpu.staged._aligned(n) for n in (0, 1, 63, 64, 65, 128, 129)] == \
        [0, 64, 64, 64, 128, 128, 192]


@pytest.mark.parametrize("size", [2, 3])
def test_a_send_of_whole_64_byte_blocks_ends_where_the_receive_region_starts(
        gpu: SimpleNamespace, size: int) -> None:
    """An allgather and an alltoall whose host send region is a multiple of 64 bytes:
    it ends exactly where the receive region starts, so it must start at the pinned
    buffer's first byte, or the two overlap (MPI forbids that; fake_comm refuses it).
    An allreduce first grows the pinned buffer, so that both regions lie in it."""
    def work(comm: ThreadComm) -> Any:
        backend = opened(gpu.staged.StagedBackend, comm)
        backend.allreduce(SET, gpu.cupy.asarray(contribution(comm.rank, 256, F32)), ReduceOp.SUM)
        mine = np.full(64, comm.rank, np.uint8)
        gathered = gpu.cupy.empty(64 * size, np.uint8)
        backend.allgather(SET, gpu.cupy.asarray(mine), gathered, [64] * size)
        blocks = np.repeat(np.arange(size, dtype=np.uint8) + 10 * comm.rank, 64)
        exchanged = gpu.cupy.empty(64 * size, np.uint8)
        backend.alltoall(SET, gpu.cupy.asarray(blocks), [64] * size, exchanged, [64] * size)
        return gathered.get(), exchanged.get()
    for rank, (gathered, exchanged) in enumerate(on_gpus(size, work)):
        np.testing.assert_array_equal(gathered, np.repeat(np.arange(size, dtype=np.uint8), 64))
        np.testing.assert_array_equal(
            exchanged, np.repeat(np.arange(size, dtype=np.uint8) * 10 + rank, 64))
