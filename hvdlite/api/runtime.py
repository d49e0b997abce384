"""Process-wide hvdlite state: one Runtime, a thin ``init()`` and ``shutdown()``.

Importing this module starts nothing: the transport (MPI's imports mpi4py, which
initialises MPI when its ``MPI`` module is imported; torchrun's imports torch) and
the engine are imported inside ``init()``, so forked DataLoader workers, launchers
and test collection never get MPI state they did not ask for.
"""
from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import sys
import threading
from typing import TYPE_CHECKING, Any, Callable, Optional

from hvdlite.api.output_pool import OutputPool
from hvdlite.config import Config
from hvdlite.errors import NotInitializedError
from hvdlite.transport import choice

if TYPE_CHECKING:
    from hvdlite.engine.engine import Engine
    from hvdlite.negotiation.set_agreement import RequestedSets
    from hvdlite.transport.topology import Topology

_log = logging.getLogger("hvdlite")


@dataclasses.dataclass
class Runtime:
    config: Optional[Config] = None
    engine: Optional["Engine"] = None
    topology: Optional["Topology"] = None
    name_counters: dict[tuple, int] = dataclasses.field(default_factory=dict)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    atexit_registered: bool = False
    outputs: OutputPool = dataclasses.field(default_factory=lambda: OutputPool(0))
    recorder: Any = None      # core.recorder.StepRecorder while HVDLITE_REPORT or _AUTOTUNE is set
    gpu_sampler: Any = None   # its api.report.GpuSampler
    tuner: Any = None         # api.autotune's Tuner while HVDLITE_AUTOTUNE runs


RUNTIME = Runtime()

# Services that live as long as a session: each start hook runs with the engine once
# init() has started it, each stop hook just before shutdown stops it (while
# collectives still work). The report (diagnostics/report.py) registers itself here, so the
# runtime imports none of its users.
START_HOOKS: list[Callable[["Engine", Config], None]] = []
STOP_HOOKS: list[Callable[[], None]] = []
# What a service adds to each rank's HVDLITE_REPORT record, by key: registered by the
# service (elastic's commit ledger), so the report imports none of them either.
REPORT_RECORDS: dict[str, Callable[[], Any]] = {}


def start(comm: Any = None, process_sets: "RequestedSets" = ()) -> bool:
    """Start the engine on every rank of ``comm`` (the body of ``hvdlite.init``), with
    ``process_sets`` (lists of global ranks) registered from the start. False, and
    nothing done, when it already runs: a second call is harmless."""
    world = choice.world_module()      # here, not at import (see the module's doc)
    world.initialize()
    from hvdlite.engine.engine import Engine
    from hvdlite.failure import abort_on_error
    with RUNTIME.lock:
        if RUNTIME.engine is not None:
            if RUNTIME.engine.dead is None:
                return False
            RUNTIME.engine.shutdown()
        config = Config.load()
        _configure_logging(config, world.world_rank())
        transport = world.open_world(comm, shared_memory=config.shared_memory)
        abort_on_error.use_transport(transport.lost_rank_wait, transport.abort)
        engine = Engine(config, transport, process_sets)
        topology = engine.start()
        # The engine's settings: the loaded ones with the topology-aware defaults applied.
        RUNTIME.config, RUNTIME.engine, RUNTIME.topology = engine.config, engine, topology
        RUNTIME.name_counters.clear()
        RUNTIME.outputs = OutputPool(config.output_pool)
        for hook in START_HOOKS:
            hook(engine, engine.config)
        if config.abort_on_error:
            abort_on_error.install(topology.rank, topology.size)
        if not RUNTIME.atexit_registered:
            atexit.register(shutdown)
            RUNTIME.atexit_registered = True
    return True


def transport_name() -> Optional[str]:
    """The running engine's transport ("mpi", "gloo"), None before init()."""
    current = RUNTIME.engine
    return None if current is None else current.transport.name


def _configure_logging(config: Config, rank: int) -> None:
    logger = logging.getLogger("hvdlite")
    logger.setLevel(config.log_level.upper())
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(f"[hvdlite rank {rank}] %(levelname)s: %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False


def shutdown() -> None:
    """Stop the engine. Other ranks' later collectives fail with ShutdownError.
    With HVDLITE_REPORT set, every rank first sends its record to rank 0, which
    writes the report (a collective, like the shutdown itself)."""
    for hook in STOP_HOOKS:
        hook()
    with RUNTIME.lock:
        engine, RUNTIME.engine = RUNTIME.engine, None
        RUNTIME.topology = None
    if engine is not None:
        engine.shutdown()


def is_initialized() -> bool:
    return RUNTIME.engine is not None


def engine(what: str = "this function") -> "Engine":
    current = RUNTIME.engine
    if current is None:
        raise NotInitializedError(what)
    current.raise_if_dead()
    return current


def release_host_fusion_buffer() -> None:
    """Give the engine's host fusion buffer back to the system; the next packed
    reduction makes a new one. For a caller that knows its packed reductions are
    over (gradients moving into buckets): the buffer would otherwise stay
    resident, sized for traffic that no longer comes."""
    current = RUNTIME.engine
    if current is not None:
        current.executor.fusion.release_host()


def step_done() -> None:
    """Mark an optimizer step boundary, on every rank, after each update. hvdlite's
    DistributedOptimizers (torch, and Keras on either backend) mark their own steps;
    a loop without them (a hand-written allreduce of the gradients, TensorFlow's
    DistributedGradientTape) calls this instead. HVDLITE_REPORT's per-step figures and
    HVDLITE_AUTOTUNE's trials count these boundaries; without either it does nothing."""
    recorder = RUNTIME.recorder
    if recorder is not None:
        recorder.step_done()


def topology(what: str) -> "Topology":
    current = RUNTIME.topology
    if current is None:
        raise NotInitializedError(what)
    return current


def rank() -> int:
    return topology("hvdlite.rank()").rank


def size() -> int:
    return topology("hvdlite.size()").size


def local_rank() -> int:
    return topology("hvdlite.local_rank()").local_rank


def local_size() -> int:
    return topology("hvdlite.local_size()").local_size


def cross_rank() -> int:
    return topology("hvdlite.cross_rank()").cross_rank


def cross_size() -> int:
    return topology("hvdlite.cross_size()").cross_size


def is_homogeneous() -> bool:
    return topology("hvdlite.is_homogeneous()").is_homogeneous


def local_device() -> int:
    """The GPU this rank should use: ``torch.cuda.set_device(hvd.local_device())``.
    Respects CUDA_VISIBLE_DEVICES (see topology.device_for_local_rank)."""
    from hvdlite.transport.topology import device_for_local_rank
    topo = topology("hvdlite.local_device()")
    return device_for_local_rank(topo.local_rank, topo.local_size,
                                 os.environ.get("CUDA_VISIBLE_DEVICES"), _gpus_present())


def _gpus_present() -> Optional[int]:
    """GPUs the driver reports, asked of a library already loaded or installed
    (torch if imported, else CuPy); None when neither can tell."""
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_available():
            return int(torch.cuda.device_count())
        import cupy
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:       # no CuPy, or no driver: fall back to one GPU per local rank
        return None


def mpi_threads_supported() -> bool:
    topology("hvdlite.mpi_threads_supported()")
    return choice.world_module().threads_multiple()


def config() -> Config:
    """The settings in force (replaced on every rank by ``reconfigure``)."""
    return engine("hvdlite.config()").config


def next_name(set_id: int, kind: str) -> tuple[str, str]:
    """(name, thread) for an unnamed op: the n-th unnamed ``kind`` on a process set
    is named the same on every rank that issues the same sequence of calls.

    Counting per set keeps overlapping sets independent. Counting per thread
    keeps unnamed ops from several threads correct: each thread's n-th op pairs
    with the same thread's n-th op on every rank, whatever the interleaving
    (threads are told apart by name, which matches across ranks when they are
    created in the same order). The thread also travels in the descriptor, so
    a pairing of different threads is a MismatchError, never a wrong result.
    """
    thread = threading.current_thread()
    own = thread is not threading.main_thread()
    key = (set_id, kind, thread.name) if own else (set_id, kind)
    with RUNTIME.lock:
        count = RUNTIME.name_counters.get(key, 0)
        RUNTIME.name_counters[key] = count + 1
    name = f"{kind}.noname.{thread.name}.{count}" if own else f"{kind}.noname.{count}"
    return name, thread.name