"""Jobs that tests/integration/test_torchrun.py runs under torchrun, one process per
rank: ``python -m tests.integration.torchrun_jobs JOB``. Each rank prints its lines
in one write each."""
from __future__ import annotations

import os
import sys
import traceback

import numpy as np


def conformance() -> None:
    """Every transport conformance check on torch.distributed's transport."""
    from hvdlite.transport import torch_transport
    from tests import transport_conformance
    torch_transport.initialize()
    world = torch_transport.open_world(None)
    for check in transport_conformance.CHECKS:
        try:
            check(world)
            print(f"PASS rank {world.rank} {check.__name__}", flush=True)
        except Exception:   # noqa: BLE001 (reported, then the job fails)
            print(f"FAIL rank {world.rank} {check.__name__}\n{traceback.format_exc()}",
                  flush=True)
            raise
    # A transport numbered against torch's order: alltoall's parts are reordered.
    reversed_world = world.split(0, key=-world.rank)
    transport_conformance.check_alltoall_array(reversed_world)
    print(f"PASS rank {world.rank} alltoall_reversed", flush=True)


def collectives() -> None:
    """hvdlite's API on the torch transport: values every rank can check."""
    import hvdlite as hvd
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    total = hvd.allreduce(np.arange(4.0) + rank, op=hvd.Sum, name="sum")
    mean = hvd.allreduce(np.full(3, float(rank)), name="mean")
    low = hvd.allreduce(np.array([rank + 5], dtype=np.int32), op=hvd.Min, name="min")
    root = hvd.broadcast(np.full(2, rank + 10.0), root_rank=size - 1, name="bcast")
    rows = hvd.allgather(np.full((rank + 1, 2), rank), name="gather")
    obj = hvd.broadcast_object({"from": rank}, root_rank=0)
    assert total.tolist() == [size * i + size * (size - 1) / 2 for i in range(4)]
    assert mean.tolist() == [(size - 1) / 2] * 3 and low.tolist() == [5]
    assert root.tolist() == [size + 9.0] * 2 and obj == {"from": 0}
    assert rows.tolist() == [[r, r] for r in range(size) for _ in range(r + 1)]
    assert hvd.gloo_built() and hvd.gloo_enabled() and not hvd.mpi_enabled()
    # A process set of the first and last ranks: split on torch, negotiated on its own.
    ends = hvd.add_process_set([0, size - 1])
    if rank in (0, size - 1):
        pair = hvd.allreduce(np.array([rank + 1.0]), op=hvd.Sum, name="pair", process_set=ends)
        assert pair.tolist() == [float(size + 1)]
    assert hvd.remove_process_set(ends)
    # Not even where mpi4py is installed: importing its MPI module starts an MPI.
    print(f"MPI rank {rank} started={'mpi4py.MPI' in sys.modules}", flush=True)
    print(f"OK rank {rank} of {size} mpi4py_loaded={'mpi4py' in sys.modules} "
          f"local={hvd.local_rank()}/{hvd.local_size()}", flush=True)
    hvd.shutdown()


ALLTOALL_DTYPES = ("uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16",
                   "float32", "float64", "bool")


def alltoall() -> None:
    """hvd.alltoall on the torch transport against a NumPy reference: every dtype
    hvdlite supports, rows of 0, 1 and primes per destination, 2-D rows, and the even
    split (no splits given)."""
    import hvdlite as hvd
    from hvdlite.negotiation.requests import to_dtype
    from tests.transport_conformance import alltoall_counts, alltoall_part
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    for name in ALLTOALL_DTYPES:
        dtype = to_dtype(name)
        counts = alltoall_counts(size, rank)
        rows = [alltoall_part(rank, to, c * 3, dtype).reshape(c, 3) for to, c in enumerate(counts)]
        got, received = hvd.alltoall(np.concatenate(rows), splits=np.array(counts),
                                     name=f"a2a.{name}")
        want = [alltoall_part(r, rank, c * 3, dtype).reshape(c, 3)
                for r, c in ((r, alltoall_counts(size, r)[rank]) for r in range(size))]
        assert got.dtype == dtype, (name, got.dtype)
        np.testing.assert_array_equal(got, np.concatenate(want), err_msg=name)
        assert list(received) == [alltoall_counts(size, r)[rank] for r in range(size)]
        even = hvd.alltoall(np.full((size * 2,), rank, dtype=dtype), name=f"even.{name}")
        np.testing.assert_array_equal(even, np.repeat(np.arange(size), 2).astype(dtype))
    print(f"ALLTOALL rank {rank} of {size}", flush=True)
    hvd.shutdown()


def registry_mismatch() -> None:
    """Rank 1 alone registers a backend: init() must fail on every rank, naming it."""
    import hvdlite as hvd
    from hvdlite.backends import register_backend
    from hvdlite.backends.on_transport import TransportBackend
    from hvdlite.errors import BackendRegistryMismatchError
    from hvdlite.transport import torch_transport
    torch_transport.initialize()
    rank = torch_transport.world_rank()
    if rank == 1:
        register_backend("extra", TransportBackend)
    try:
        hvd.init()
    except BackendRegistryMismatchError as error:
        print(f"MISMATCH rank {rank} ranks={error.ranks} backends={error.backends}: {error}",
              flush=True)


def architecture_backend() -> None:
    """The backend that docs/ARCHITECTURE.md shows a user writing, run as the page has it:
    it moves its data with the transport's own calls, so it serves torchrun's world too
    (its block also runs under mpiexec with the other docs' examples)."""
    from tests.integration import docs_examples
    page = docs_examples.ROOT / "docs" / "ARCHITECTURE.md"
    (block,) = [b for b in docs_examples.blocks(page) if "class GatherBackend" in b.code]
    exec(compile(block.code, str(page), "exec"), {"__name__": "__main__"})   # noqa: S102
    print(f"EXAMPLE BACKEND rank {int(os.environ['RANK'])} passed", flush=True)


def lost_peer() -> None:
    """Rank 1 exits after a first allreduce; the others' next one must fail with
    PeerLostError (found by the liveness check over the store and /proc)."""
    import os
    import time

    import hvdlite as hvd
    hvd.init()
    hvd.allreduce(np.ones(1), name="warm")
    if hvd.rank() == 1:
        time.sleep(0.5)
        os._exit(3)
    try:
        hvd.allreduce(np.ones(1), name="after")
    except hvd.PeerLostError as error:
        print(f"LOST rank {hvd.rank()}: {error}", flush=True)


def shared_memory() -> None:
    """Host data through the node's shared memory (over Gloo with
    HVDLITE_SHARED_MEMORY=0): values every rank can check, in the world and in a
    process set; each rank says which way its world's data went."""
    import os

    import hvdlite as hvd
    from hvdlite.transport import torch_transport
    if "UNDUMPABLE_RANK" in os.environ:
        _without_ptrace_capability()
        if os.environ["UNDUMPABLE_RANK"] == os.environ["RANK"]:
            _undumpable()
    opened: list[bool] = []          # each transport's outcome, as it opens at its first allreduce
    open_node_memory = torch_transport.open_node_memory

    def recorded(*args: object, **kwargs: object) -> object:
        memory = open_node_memory(*args, **kwargs)   # type: ignore[arg-type]
        opened.append(memory is not None)
        return memory

    torch_transport.open_node_memory = recorded        # type: ignore[assignment]
    hvd.init()
    loops_after_init = _gloo_loop_threads()
    rank, size = hvd.rank(), hvd.size()
    ramp = np.arange(1_000_003, dtype=np.float32)      # 4 MB: spans chunks of 2 MiB
    total = hvd.allreduce(ramp * (rank + 1), op=hvd.Sum, name="ramp")
    assert np.array_equal(total, ramp * (size * (size + 1) // 2))
    wraps = hvd.allreduce(np.full(5, 2**63 + rank, dtype=np.uint64), op=hvd.Sum, name="u64")
    assert wraps.tolist() == [(size * 2**63 + size * (size - 1) // 2) % 2**64] * 5
    high = hvd.allreduce(np.array([-rank, rank], dtype=np.int16), op=hvd.Max, name="i16")
    assert high.tolist() == [0, size - 1]
    odd = list(range(1, size, 2))          # a set that is not the world
    odd_set = hvd.add_process_set(odd)
    if rank in odd:
        part = hvd.allreduce(np.full(7, rank + 1.0), op=hvd.Sum, name="odd", process_set=odd_set)
        assert part.tolist() == [float(sum(r + 1 for r in odd))] * 7
    assert hvd.remove_process_set(odd_set)
    hvd.allreduce(np.zeros(1), name="done")
    from hvdlite.api.runtime import RUNTIME
    world_round = type(RUNTIME.engine.registry.members()[0].round._band).__name__
    print(f"SHM rank {rank} opened={opened} round={world_round} gloo loops: "
          f"{loops_after_init} after init, {_gloo_loop_threads()} after a set came and went",
          flush=True)
    print(f"SEGMENTS rank {rank} held={len(_held_segments())}", flush=True)
    hvd.shutdown()


def _undumpable() -> None:
    """This process made undumpable (prctl PR_SET_DUMPABLE 0), as a setuid program or a
    hardened service is: other processes of its user may no longer open its files
    through /proc/PID/fd."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(4, 0, 0, 0, 0) != 0:                  # PR_SET_DUMPABLE
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")


def _without_ptrace_capability() -> None:
    """CAP_SYS_PTRACE out of this process's capabilities, as an ordinary user's process
    has it (root's may open any process's files through /proc/PID/fd). Out of the
    permitted ones too: the kernel lets a process without it open the files of one only
    whose permitted capabilities its own effective ones include."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)       # _LINUX_CAPABILITY_VERSION_3, self
    data = (ctypes.c_uint32 * 6)()                      # effective, permitted, inheritable x2
    if libc.capget(header, data) != 0:
        raise OSError(ctypes.get_errno(), "capget failed")
    data[0] &= ~(1 << 19)                               # CAP_SYS_PTRACE: effective,
    data[1] &= ~(1 << 19)                               # permitted
    if libc.capset(header, data) != 0:
        raise OSError(ctypes.get_errno(), "capset failed")


def _held_segments() -> list[str]:
    """This process's descriptors and mappings of node-memory segments."""
    import os
    from pathlib import Path
    held = []
    for fd in Path("/proc/self/fd").iterdir():
        try:
            if os.readlink(fd).startswith("/memfd:hvdlite"):
                held.append(str(fd))
        except OSError:         # closed as we looked
            pass
    maps = Path("/proc/self/maps").read_text().splitlines()
    return held + [line for line in maps if "/memfd:hvdlite" in line]


def dies_in_shared_memory_setup() -> None:
    """Rank 1 SIGKILLs itself at its second exchange of the node memory's set-up, once
    its segment is made: what was new in /dev/shm then, and the segments it held, go
    to SHM_SEEN (JSON) for the test to look for after the job. The others' init or
    first allreduce fails; torchrun ends them."""
    import json
    import os
    import signal
    from pathlib import Path

    import torch.distributed as dist

    import hvdlite as hvd
    from hvdlite.transport import torch_transport

    def entries() -> dict[str, int]:
        found = {}
        for path in Path("/dev/shm").iterdir():
            try:
                found[path.name] = path.stat().st_ino
            except OSError:      # removed as we looked
                pass
        return found

    before = entries()
    open_node_memory, allgather = torch_transport.open_node_memory, \
        torch_transport.TorchTransport.allgather
    set_up = {"begun": False, "exchanges": 0}

    def opening(*args: object, **kwargs: object) -> object:
        set_up["begun"] = True
        return open_node_memory(*args, **kwargs)       # type: ignore[arg-type]

    def exchange(self: torch_transport.TorchTransport, obj: object) -> list[object]:
        if set_up["begun"] and dist.get_rank() == 1:
            set_up["exchanges"] += 1
            if set_up["exchanges"] == 2:
                new = {n: i for n, i in entries().items() if before.get(n) != i}
                Path(os.environ["SHM_SEEN"]).write_text(
                    json.dumps({"new": new, "held": _held_segments()}))
                os.kill(os.getpid(), signal.SIGKILL)
        return allgather(self, obj)

    torch_transport.open_node_memory = opening                   # type: ignore[assignment]
    torch_transport.TorchTransport.allgather = exchange          # type: ignore[method-assign]
    try:
        hvd.init()
        hvd.allreduce(np.ones(4), name="first")
    except Exception as error:  # noqa: BLE001 (the survivors say what they saw)
        print(f"FAILED rank {dist.get_rank()}: {type(error).__name__}", flush=True)


def _gloo_loop_threads() -> int:
    """Gloo's threads of this process: one a process group, each waking 100 times a
    second however idle its group."""
    import glob
    names = []
    for comm in glob.glob("/proc/self/task/*/comm"):
        try:
            with open(comm) as file:
                names.append(file.read().strip())
        except OSError:         # a thread that ended as we looked
            pass
    return names.count("gloo_tcp_loop")


def lost_in_shared_memory() -> None:
    """Rank 1 exits inside an allreduce through the node's shared memory, after its
    first arrival; the others, waiting for its second, must fail with PeerLostError."""
    import os

    import hvdlite as hvd
    from hvdlite.transport import node_memory
    hvd.init()
    hvd.allreduce(np.ones(4), name="warm")              # one chunk: two arrivals
    if hvd.rank() == 1:
        arrive = node_memory.NodeMemory._arrive

        def exit_at_the_fourth(memory: node_memory.NodeMemory) -> None:
            if memory._arrivals == 3:
                os._exit(3)
            arrive(memory)

        node_memory.NodeMemory._arrive = exit_at_the_fourth      # type: ignore[method-assign]
    try:
        hvd.allreduce(np.ones(4), name="after")
    except hvd.PeerLostError as error:
        print(f"LOST rank {hvd.rank()}: {error}", flush=True)


def horovod_launch_variables() -> None:
    """Under hvdliterun --gloo: Horovod's launcher variables, read before init() (as a
    script picking its GPU does), agree with what init() says; then one allreduce."""
    import os

    import hvdlite as hvd
    env = {name: os.environ.get(f"HOROVOD_{name}") for name in
           ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE")}
    hvd.init()
    seen = {"RANK": hvd.rank(), "SIZE": hvd.size(), "LOCAL_RANK": hvd.local_rank(),
            "LOCAL_SIZE": hvd.local_size(), "CROSS_RANK": hvd.cross_rank(),
            "CROSS_SIZE": hvd.cross_size()}
    assert env == {name: str(value) for name, value in seen.items()}, (env, seen)
    assert hvd.gloo_enabled() and not hvd.mpi_enabled()
    total = hvd.allreduce(np.array([hvd.rank() + 1.0]), op=hvd.Sum, name="total")
    assert total[0] == hvd.size() * (hvd.size() + 1) / 2, total
    print(f"HOROVOD rank {hvd.rank()} of {hvd.size()} {sorted(env.items())} "
          f"knob={os.environ.get('HVDLITE_CYCLE_TIME')}", flush=True)
    if os.environ.get("FAIL_RANK") == str(hvd.rank()):
        sys.exit(7)
    hvd.shutdown()


def hear_out_the_survivors() -> None:
    """With SURVIVORS_SPEAK=1, ignore the SIGTERM with which torchrun's agent ends the
    other workers once one has failed: a survivor then says what it found and ends on
    its own (the agent sends SIGKILL 30 s after SIGTERM), whenever the agent looks."""
    import os
    import signal
    if os.environ.get("SURVIVORS_SPEAK") == "1":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


if __name__ == "__main__":
    hear_out_the_survivors()
    {"horovod_launch_variables": horovod_launch_variables, "conformance": conformance, "collectives": collectives,
     "lost_peer": lost_peer, "alltoall": alltoall, "shared_memory": shared_memory,
     "architecture_backend": architecture_backend,
     "lost_in_shared_memory": lost_in_shared_memory,
     "dies_in_shared_memory_setup": dies_in_shared_memory_setup,
     "registry_mismatch": registry_mismatch}[sys.argv[1]]()
