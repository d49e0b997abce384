"""The GPU backends (hvdlite/backends/gpu.py, cuda.py, nccl.py, staged.py) without
a GPU: imported under tests/unit/fake_cupy.py and fake_nccl.py (CuPy and NCCL
over NumPy, one thread per rank) with tests/unit/fake_comm.py as MPI, at 1 to 4
ranks (tests/unit/gpu_ranks.py). Found necessary by make mutate: their real
tests (tests/mpi/test_gpu_torch.py) need a GPU, so no mutant of them could be
judged. What the fakes cannot show (streams running concurrently, NCCL's own
reduction order and rounding) is said in theirs; the staged backend's own tests
are in test_gpu_staged.py.

Values are small integers, exact in every dtype and order; expected results come
from rank and size, and every rank's are checked."""
from __future__ import annotations

import sys
from types import SimpleNamespace
from typing import Any, Callable

import numpy as np
import pytest

import hvdlite.backends
from hvdlite.backends.base import even_counts
from hvdlite.config import Config
from hvdlite.reduce_op import ReduceOp
from hvdlite.transport.mpi_transport import MpiTransport
from tests.unit import fake_cupy, fake_nccl
from tests.unit.fake_comm import ThreadComm
from tests.unit.gpu_ranks import (BF16, DTYPES, ELEMENTWISE, F16, F32, MODULES, SET, SIZES,
                                  config, contribution, loader, moved, nccl_calls, on_gpus,
                                  opened, reduced, widened_size)


def test_the_fake_leaves_nothing_behind() -> None:
    """After a test, no fake module, no backend module imported under it and no
    fake state stays behind (nothing else can import them: there is no CuPy)."""
    names = ["cupy", "cupy.cuda", "cupy.cuda.nccl"] + [f"hvdlite.backends.{n}" for n in MODULES]
    states = (fake_cupy.state(), fake_nccl.state())
    with pytest.MonkeyPatch.context() as monkeypatch:
        modules = loader(monkeypatch)()
        assert sys.modules["cupy"] is modules.cupy and hvdlite.backends.gpu is modules.gpu
        assert sys.modules["cupy.cuda.nccl"].get_version() == 21805
    assert not any(name in sys.modules for name in names)
    assert not any(hasattr(hvdlite.backends, name) for name in MODULES)
    assert (fake_cupy.state(), fake_nccl.state()) == states


def test_the_fake_aligns_allocations_as_cuda_promises_and_no_more(gpu: SimpleNamespace) -> None:
    """256-byte aligned with bits 8-19 set: a pointer plus an offset of 256 bytes or
    more differs from the pointer or'ed or xor'ed with it."""
    bases = [gpu.cupy.empty(n, np.uint8).data.ptr for n in (1, 300, 5000)]
    assert all(base % 256 == 0 and base >> 8 & 0xFFF == 0xFFF for base in bases)
    assert bases == sorted(bases) and min(np.diff(bases)) > 1 << 20
    with pytest.raises(fake_cupy.CUDARuntimeError, match="IllegalAddress"):
        fake_cupy.resolve(bases[1] - 256, 4, 0)
    with pytest.raises(fake_cupy.CUDARuntimeError, match="IllegalAddress"):
        fake_cupy.resolve(bases[1] + 297, 4, 0)


# --- cuda.py: devices and streams ------------------------------------------------------

def test_device_index_reads_the_ordinal_after_the_colon(gpu: SimpleNamespace) -> None:
    assert [gpu.cuda.device_index(d) for d in ("cuda", "cuda:0", "cuda:3", "cuda:12")] == \
        [0, 0, 3, 12]


def test_each_gpu_has_one_non_blocking_engine_stream_of_its_own(gpu: SimpleNamespace) -> None:
    fake_cupy.Device(1).use()
    second, third = gpu.cuda.stream_for(2), gpu.cuda.stream_for(3)
    assert (second.device, third.device) == (2, 3)          # made on its own GPU
    assert second.non_blocking and third.non_blocking
    assert gpu.cuda.stream_for(2) is second and second is not third
    assert fake_cupy.Device().id == 1                       # the current GPU is restored
    assert gpu.cuda.current_stream() is gpu.cuda.stream_for(1)
    fake_cupy.Device(3).use()
    assert gpu.cuda.current_stream() is third


def test_stream_work_is_ordered_and_done_when_its_event_fired(gpu: SimpleNamespace) -> None:
    stream = gpu.cuda.stream_for(0)
    assert gpu.cuda.StreamWork.ordered is True
    finished = gpu.cuda.StreamWork(stream)
    assert finished.event.stream is stream and finished.event.disable_timing
    assert stream.log[-1] == ("record", finished.event)
    assert finished.done()
    stream.busy = True                      # the GPU has not reached the event yet
    pending = gpu.cuda.StreamWork(stream)
    assert not pending.done()
    pending.wait()
    assert pending.done()


# --- gpu.py: the plugin --------------------------------------------------------------

def test_prepare_makes_the_gpu_current_and_its_stream_wait_on_every_ready_event(
        gpu: SimpleNamespace) -> None:
    fake_cupy.Device(2).use()
    framework = fake_cupy.Stream()
    ready = [fake_cupy.Event(), fake_cupy.Event()]
    for event in ready:
        event.record(framework)
    fake_cupy.Device(0).use()
    gpu.gpu.prepare("cuda:2", ready)
    stream = gpu.cuda.stream_for(2)
    assert fake_cupy.Device().id == 2
    assert fake_cupy.get_current_stream() is stream      # the engine thread's work goes there
    assert stream.log == [("wait", ready[0]), ("wait", ready[1])]
    gpu.gpu.prepare("cuda:2", [])
    assert stream.log == [("wait", ready[0]), ("wait", ready[1])]


def test_fence_is_an_event_recorded_on_the_engine_stream_of_that_gpu(
        gpu: SimpleNamespace) -> None:
    fake_cupy.Device(0).use()
    event = gpu.gpu.fence("cuda:1")
    stream = gpu.cuda.stream_for(1)
    assert isinstance(event, fake_cupy.Event) and event.disable_timing
    assert event.stream is stream and stream.log == [("record", event)]


def test_nccl_comes_first_where_it_loads_and_staging_always(
        load: Callable[..., SimpleNamespace]) -> None:
    modules = load()
    assert modules.gpu.NAMESPACE is modules.cupy
    torch_nccl = modules.torch_nccl.TorchNcclBackend     # torchrun's sets only (torch's NCCL)
    assert modules.gpu.BACKENDS == [torch_nccl, modules.nccl.NcclBackend,
                                    modules.staged.StagedBackend]
    for missing in (None, 0):           # a CuPy without NCCL; an NCCL that reports no version
        modules = load(missing)
        assert not modules.nccl.NCCL_AVAILABLE
        assert modules.gpu.BACKENDS == [modules.torch_nccl.TorchNcclBackend,
                                        modules.staged.StagedBackend]
        assert not modules.nccl.NcclBackend(config()).supports("allreduce", F32, "cuda:0", 4)


# --- nccl.py ---------------------------------------------------------------------------

def test_nccl_supports_its_types_on_gpus_when_chosen(gpu: SimpleNamespace) -> None:
    backend = gpu.nccl.NcclBackend(config())
    for dtype in DTYPES + [np.dtype(np.uint32), np.dtype(np.uint64)]:
        for op in ELEMENTWISE:
            assert backend.supports("allreduce", dtype, "cuda:1", 8, op)
        assert not backend.supports("allreduce", dtype, "cuda:0", 8, ReduceOp.ADASUM)
        assert not backend.supports("allreduce", dtype, "cpu", 8)
        assert backend.reduction_dtype(dtype) == dtype          # half types natively
    for dtype in (np.int16, np.bool_, np.complex64):
        assert not backend.supports("allgather", np.dtype(dtype), "cuda:0", 8)
    backend.configure(config(gpu_allreduce="mpi"))
    assert not backend.supports("allreduce", F32, "cuda:0", 8)
    backend.configure(config(gpu_allreduce="nccl"))
    assert backend.supports("allreduce", F32, "cuda:0", 8)
    assert gpu.nccl.NcclBackend(config(gpu_allreduce="mpi")).supports(
        "allreduce", F32, "cuda:0", 8) is False
    chosen = Config.load({"HVDLITE_GPU_ALLREDUCE": " NCCL"})   # a string made at run time
    assert gpu.nccl.NcclBackend(chosen).supports("allreduce", F32, "cuda:0", 8)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nccl_allreduce_each_op_in_place(gpu: SimpleNamespace, size: int,
                                         dtype: np.dtype) -> None:
    n = 5

    def work(comm: ThreadComm) -> list[Any]:
        backend = opened(gpu.nccl.NcclBackend, comm)
        results = []
        for op in ELEMENTWISE:
            buf = gpu.cupy.asarray(contribution(comm.rank, n, dtype, op))
            done = backend.allreduce(SET, buf, op)
            results.append((buf.get(), done.event.stream))
        stream = gpu.cuda.stream_for(comm.rank)
        return results, stream, nccl_calls(stream), backend.traffic.snapshot()
    for rank, (results, stream, calls, traffic) in enumerate(on_gpus(size, work)):
        for op, (result, recorded) in zip(ELEMENTWISE, results):
            np.testing.assert_array_equal(result, reduced(size, n, dtype, op), f"{op} rank {rank}")
            assert result.dtype == dtype and recorded is stream
        assert calls == [("nccl", "allreduce", n)] * len(ELEMENTWISE)
        estimate = 2 * n * dtype.itemsize * (size - 1) // size * len(ELEMENTWISE)
        assert traffic["allreduce"] == {"calls": 5, "sent": estimate, "received": estimate}


@pytest.mark.parametrize("size", SIZES)
def test_nccl_allreduce_many_in_groups_of_group_ops(gpu: SimpleNamespace, size: int,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Seven tensors of mixed dtypes in groups of 3 (at most 3 per NCCL group)."""
    assert 0 < gpu.nccl._GROUP_OPS <= fake_nccl.MAX_GROUP_OPS     # what older NCCL accepts
    monkeypatch.setattr(gpu.nccl, "_GROUP_OPS", 3)
    monkeypatch.setattr(fake_nccl, "MAX_GROUP_OPS", 3)
    dtypes = [F32, F16, BF16, np.dtype(np.int32), F32, np.dtype(np.float64), np.dtype(np.int8)]

    def work(comm: ThreadComm) -> Any:
        backend = opened(gpu.nccl.NcclBackend, comm)
        pairs = [(gpu.cupy.asarray(contribution(comm.rank, 3 + i, dtype)),
                  gpu.cupy.empty(3 + i, dtype)) for i, dtype in enumerate(dtypes)]
        done = backend.allreduce_many(SET, pairs, ReduceOp.SUM)
        assert done.event.stream is gpu.cuda.stream_for(comm.rank)
        return ([(s.get(), t.get()) for s, t in pairs], backend.traffic.snapshot())
    results = on_gpus(size, work)
    for rank, (pairs, traffic) in enumerate(results):
        for i, (dtype, (source, target)) in enumerate(zip(dtypes, pairs)):
            np.testing.assert_array_equal(target, reduced(size, 3 + i, dtype, ReduceOp.SUM))
            np.testing.assert_array_equal(source, contribution(rank, 3 + i, dtype))  # untouched
        nbytes = sum((3 + i) * np.dtype(d).itemsize for i, d in enumerate(dtypes))
        estimate = 2 * nbytes * (size - 1) // size
        assert traffic["allreduce"] == {"calls": 1, "sent": estimate, "received": estimate}
    groups = fake_nccl.state().groups
    assert sorted(groups) == sorted((rank, ops) for rank in range(size) for ops in (3, 3, 1))


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("version", [21805, 21000, 20907])
@pytest.mark.parametrize("n", [0, 1, 17, 4913])
def test_nccl_average_is_a_sum_in_every_element_never_ncclavg(
        load: Callable[..., SimpleNamespace], size: int, version: int, n: int) -> None:
    """Average reaches NCCL as a Sum (the executor divides after), in groups and
    alone: ncclAvg out of place on one rank leaves the tail unwritten (NCCL 2.28.9,
    as the fake models it), so every element past the last block of 16 would hold
    what the output held before."""
    gpu = load(version)
    dtypes = [F32, F16, BF16, np.dtype(np.float64), np.dtype(np.int32)]

    def work(comm: ThreadComm) -> Any:
        backend = opened(gpu.nccl.NcclBackend, comm)
        pairs = [(gpu.cupy.asarray(contribution(comm.rank, n, d)),
                  gpu.cupy.asarray(np.full(n, 99, d))) for d in dtypes]   # stale outputs
        backend.allreduce_many(SET, pairs, ReduceOp.AVERAGE)
        single = gpu.cupy.asarray(contribution(comm.rank, n, F32))
        backend.allreduce(SET, single, ReduceOp.AVERAGE)
        return [t.get() for _, t in pairs], single.get()
    for many, single in on_gpus(size, work):
        for dtype, target in zip(dtypes, many):
            np.testing.assert_array_equal(target, reduced(size, n, dtype, ReduceOp.SUM),
                                          str(dtype))
        np.testing.assert_array_equal(single, reduced(size, n, F32, ReduceOp.SUM))


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("which", ["first", "middle", "last"])
def test_nccl_broadcast_from_any_root(gpu: SimpleNamespace, size: int, which: str) -> None:
    root = {"first": 0, "middle": size // 2, "last": size - 1}[which]

    def work(comm: ThreadComm) -> Any:
        backend = opened(gpu.nccl.NcclBackend, comm)
        results = []
        for dtype in (F32, BF16, np.dtype(np.int64)):
            buf = gpu.cupy.asarray(contribution(comm.rank, 6, dtype))
            backend.broadcast(SET, buf, root)
            results.append(buf.get())
        return results, backend.traffic.snapshot()
    for rank, (results, traffic) in enumerate(on_gpus(size, work)):
        for dtype, result in zip((F32, BF16, np.dtype(np.int64)), results):
            np.testing.assert_array_equal(result, contribution(root, 6, dtype))
        nbytes = 6 * (4 + 2 + 8)
        expected = {"calls": 3, "sent": nbytes if rank == root else 0,
                    "received": 0 if rank == root else nbytes}
        assert traffic.get("broadcast") == (expected if size > 1 else None)


def uneven_rows(rank: int, size: int) -> np.ndarray:
    """Rank r holds (r + 1) % 3 rows of 70 float32 (rank 2 none): its bytes (so
    that ranks' blocks start 280 bytes or more into the result)."""
    rows = (rank + 1) % 3
    return (np.arange(rows * 70, dtype=np.float32) + 1000 * rank).view(np.uint8)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("backend_name", ["nccl", "staged"])
def test_allgather_of_uneven_first_dimensions(gpu: SimpleNamespace, size: int,
                                              backend_name: str) -> None:
    counts = [uneven_rows(r, size).size for r in range(size)]
    factory = {"nccl": gpu.nccl.NcclBackend, "staged": gpu.staged.StagedBackend}[backend_name]

    def work(comm: ThreadComm) -> Any:
        backend = opened(factory, comm)
        send = gpu.cupy.asarray(uneven_rows(comm.rank, size))
        recv = gpu.cupy.empty(sum(counts), np.uint8)
        backend.allgather(SET, send, recv, counts)
        return recv.get(), backend.traffic.snapshot()["allgather"]
    expected = np.concatenate([uneven_rows(r, size) for r in range(size)])
    for rank, (result, traffic) in enumerate(on_gpus(size, work)):
        np.testing.assert_array_equal(result, expected)
        others = sum(counts) - counts[rank]
        assert traffic == {"calls": 1, "sent": others, "received": others}


def alltoall_block(source: int, dest: int) -> np.ndarray:
    """What rank ``source`` sends rank ``dest``: 200 ((2 source + dest) % 3) + source
    + 1 bytes, so that what a rank sends a peer and receives from it differ in
    length, a rank sends itself something (which moves nothing), and blocks start
    hundreds of bytes in; bytes that differ along the block (period 251)."""
    n = 200 * ((2 * source + dest) % 3) + source + 1
    return ((np.arange(n) * 37 + 16 * source + dest) % 251).astype(np.uint8)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("backend_name", ["nccl", "staged"])
def test_alltoall_of_uneven_blocks(gpu: SimpleNamespace, size: int, backend_name: str) -> None:
    factory = {"nccl": gpu.nccl.NcclBackend, "staged": gpu.staged.StagedBackend}[backend_name]

    def work(comm: ThreadComm) -> Any:
        me, backend = comm.rank, opened(factory, comm)
        blocks = [alltoall_block(me, dest) for dest in range(size)]
        send_counts = [b.size for b in blocks]
        recv_counts = [alltoall_block(src, me).size for src in range(size)]
        send = gpu.cupy.asarray(np.concatenate(blocks))
        recv = gpu.cupy.empty(sum(recv_counts), np.uint8)
        backend.alltoall(SET, send, send_counts, recv, recv_counts)
        others = (sum(send_counts) - send_counts[me], sum(recv_counts) - recv_counts[me])
        return recv.get(), moved(backend, "alltoall"), others
    for rank, (result, traffic, others) in enumerate(on_gpus(size, work)):
        expected = np.concatenate([alltoall_block(src, rank) for src in range(size)])
        np.testing.assert_array_equal(result, expected)
        assert traffic == others


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("backend_name", ["nccl", "staged"])
@pytest.mark.parametrize("dtype", [F32, F16, np.dtype(np.int64)], ids=str)
def test_reducescatter_of_counts_uneven_by_a_row(gpu: SimpleNamespace, size: int,
                                                 backend_name: str, dtype: np.dtype) -> None:
    n = 130 * size + 1                   # a rank's part starts 262 bytes in or more
    counts = even_counts(n, size)
    factory = {"nccl": gpu.nccl.NcclBackend, "staged": gpu.staged.StagedBackend}[backend_name]

    def work(comm: ThreadComm) -> Any:
        backend = opened(factory, comm)
        results = []
        for op in ELEMENTWISE:
            buf = gpu.cupy.asarray(contribution(comm.rank, n, dtype, op))
            out = gpu.cupy.empty(counts[comm.rank], dtype)
            backend.reducescatter(SET, buf, counts, out, op)
            results.append(out.get())
        return results, backend.traffic.snapshot().get("reducescatter")
    for rank, (results, traffic) in enumerate(on_gpus(size, work)):
        start = sum(counts[:rank])
        for op, result in zip(ELEMENTWISE, results):
            expected = reduced(size, n, dtype, op)[start: start + counts[rank]]
            np.testing.assert_array_equal(result, expected, f"{op} rank {rank}")
        wide = dtype.itemsize if backend_name == "nccl" else widened_size(dtype)
        if backend_name == "nccl" or size > 1:     # one rank: MPI's backend copies, uncounted
            others = (n - counts[rank]) * wide * len(ELEMENTWISE)
            assert traffic == {"calls": 5, "sent": others, "received": others}
        else:
            assert traffic is None


# --- the decision to stage: ranks that share a GPU -------------------------------------

def run_every_kind(gpu: SimpleNamespace, comm: ThreadComm) -> dict[str, Any]:
    """One of each collective through the NCCL backend; what each rank got."""
    me, size = comm.rank, comm.Get_size()
    backend = opened(gpu.nccl.NcclBackend, comm)
    out: dict[str, Any] = {}
    buf = gpu.cupy.asarray(contribution(me, 4, F16))
    backend.allreduce(SET, buf, ReduceOp.SUM)
    out["allreduce"] = buf.get()
    pair = [(gpu.cupy.asarray(contribution(me, 4, F32)), gpu.cupy.empty(4, F32))]
    out["many"] = backend.allreduce_many(SET, pair, ReduceOp.SUM)
    buf = gpu.cupy.asarray(contribution(me, 4, F32))
    backend.broadcast(SET, buf, size - 1)
    out["broadcast"] = buf.get()
    counts = [uneven_rows(r, size).size for r in range(size)]
    recv = gpu.cupy.empty(sum(counts), np.uint8)
    backend.allgather(SET, gpu.cupy.asarray(uneven_rows(me, size)), recv, counts)
    out["allgather"] = recv.get()
    buf, part = gpu.cupy.asarray(contribution(me, size, BF16)), gpu.cupy.empty(1, BF16)
    backend.reducescatter(SET, buf, [1] * size, part, ReduceOp.SUM)
    out["reducescatter"] = part.get()
    blocks = [alltoall_block(me, dest) for dest in range(size)]
    recv_counts = [alltoall_block(src, me).size for src in range(size)]
    recv = gpu.cupy.empty(sum(recv_counts), np.uint8)
    backend.alltoall(SET, gpu.cupy.asarray(np.concatenate(blocks)), [b.size for b in blocks],
                     recv, recv_counts)
    out["alltoall"] = recv.get()
    out["nccl calls"] = sum(ops for rank, ops in fake_nccl.state().groups if rank == me)
    out["mpi collectives"] = comm.world.collectives
    backend.close_set(SET)
    return out


def check_every_kind(results: list[dict[str, Any]], size: int) -> None:
    gathered = np.concatenate([uneven_rows(r, size) for r in range(size)])
    for rank, out in enumerate(results):
        np.testing.assert_array_equal(out["allreduce"], reduced(size, 4, F16, ReduceOp.SUM))
        np.testing.assert_array_equal(out["broadcast"], contribution(size - 1, 4, F32))
        np.testing.assert_array_equal(out["allgather"], gathered)
        np.testing.assert_array_equal(out["reducescatter"],
                                      reduced(size, size, BF16, ReduceOp.SUM)[rank: rank + 1])
        np.testing.assert_array_equal(
            out["alltoall"], np.concatenate([alltoall_block(src, rank) for src in range(size)]))


@pytest.mark.parametrize("size", [2, 3, 4])
def test_ranks_sharing_a_gpu_are_staged_every_member_alike(gpu: SimpleNamespace,
                                                           size: int) -> None:
    """Ranks 0 and the last share GPU 0: the whole set is staged (NCCL would refuse
    it), allreduce_many declines (the executor fuses), and nothing reaches NCCL."""
    results = on_gpus(size, lambda comm: run_every_kind(gpu, comm),
                      device=lambda rank: 0 if rank == size - 1 else rank)
    check_every_kind(results, size)
    for out in results:
        assert out["many"] is None and out["nccl calls"] == 0
    assert fake_nccl.state().communicators == []


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_one_gpu_per_rank_uses_nccl_made_once_per_set(gpu: SimpleNamespace, size: int,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Two nodes, GPUs numbered from 0 on each (so the same ordinals recur): one NCCL
    communicator per rank, after one allgather of the placement and one broadcast of
    the id; no MPI after that; destroyed when the set closes."""
    monkeypatch.setattr(gpu.gpu_sets, "socket", SimpleNamespace(gethostname=fake_cupy.hostname))

    def work(comm: ThreadComm) -> dict[str, Any]:
        fake_cupy.set_host(f"node{comm.rank % 2}")
        return run_every_kind(gpu, comm)
    results = on_gpus(size, work, device=lambda rank: rank // 2)
    check_every_kind(results, size)
    gathers = sum(1 for r in range(size) if uneven_rows(r, size).size)
    for out in results:
        assert out["many"] is not None
        # a reduce per rank, a send and a receive per rank (itself too)
        assert out["nccl calls"] == 3 + gathers + size + 2 * size
        assert out["mpi collectives"] == 2 * size               # counted once per rank
    communicators = fake_nccl.state().communicators
    assert len(communicators) == size and not any(c.alive for c in communicators)
    assert fake_nccl.state().unique_ids == [("node0", 0)]      # rank 0's, and only it


def test_a_closed_set_reopened_gets_a_new_communicator(gpu: SimpleNamespace) -> None:
    def work(comm: ThreadComm) -> list[Any]:
        backend = opened(gpu.nccl.NcclBackend, comm)
        sums = []
        for _ in range(2):
            buf = gpu.cupy.asarray(contribution(comm.rank, 3, F32))
            backend.allreduce(SET, buf, ReduceOp.SUM)
            sums.append(buf.get())
            backend.close_set(SET)
            backend.open_set(SET, MpiTransport(comm))
        return sums
    for sums in on_gpus(2, work):
        for result in sums:
            np.testing.assert_array_equal(result, reduced(2, 3, F32, ReduceOp.SUM))
    first, second = fake_nccl.state().communicators[:2], fake_nccl.state().communicators[2:]
    assert len(second) == 2 and not any(c.alive for c in first + second)
    assert len(fake_nccl.state().unique_ids) == 2


def test_a_set_of_more_than_256_ranks(gpu: SimpleNamespace,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """258 ranks, a node each: rank numbers and sizes past 256 are compared by value
    (CPython shares one int object per value only up to 256). The last rank is
    the root of a broadcast and has a part of an allgather and a reducescatter."""
    size, last = 258, 257
    monkeypatch.setattr(gpu.gpu_sets, "socket", SimpleNamespace(gethostname=fake_cupy.hostname))
    has_part = [int(r in (0, last)) for r in range(size)]

    def work(comm: ThreadComm) -> Any:
        me = comm.rank
        fake_cupy.set_host(f"node{me}")
        backend = opened(gpu.nccl.NcclBackend, comm)
        buf = gpu.cupy.asarray(contribution(me, 4, F32))
        backend.broadcast(SET, buf, size - 1)
        gathered = gpu.cupy.empty(8, np.uint8)
        mine = np.full(4 * has_part[me], me % 256, np.uint8)
        backend.allgather(SET, gpu.cupy.asarray(mine), gathered, [4 * p for p in has_part])
        part = gpu.cupy.empty(has_part[me], F32)
        backend.reducescatter(SET, gpu.cupy.asarray(contribution(me, 2, F32)), has_part,
                              part, ReduceOp.SUM)
        return buf.get(), moved(backend, "broadcast"), gathered.get(), part.get()
    results = on_gpus(size, work, device=lambda rank: 0)
    assert len(fake_nccl.state().communicators) == size      # NCCL, not staged
    total = reduced(size, 2, F32, ReduceOp.SUM)
    for rank, (value, traffic, gathered, part) in enumerate(results):
        np.testing.assert_array_equal(value, contribution(last, 4, F32))
        assert traffic == ((16, 0) if rank == last else (0, 16))
        np.testing.assert_array_equal(gathered, [0] * 4 + [last % 256] * 4)
        np.testing.assert_array_equal(part, {0: total[:1], last: total[1:]}.get(rank, total[:0]))
