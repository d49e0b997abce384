"""Process-wide hvdlite state: one State object, a thin init() and shutdown()."""
from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import threading
from typing import Iterable, Optional, Sequence, Union

from mpi4py import MPI

from hvdlite.config import Config
from hvdlite.core import failure
from hvdlite.core.engine import Engine
from hvdlite.core.process_sets import ProcessSet
from hvdlite.core.topology import Topology, check_launch
from hvdlite.errors import HvdliteError, NotInitializedError

_log = logging.getLogger("hvdlite")


@dataclasses.dataclass
class State:
    config: Optional[Config] = None
    engine: Optional[Engine] = None
    topology: Optional[Topology] = None
    process_sets: dict[int, ProcessSet] = dataclasses.field(default_factory=dict)
    name_counters: dict[str, int] = dataclasses.field(default_factory=dict)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    atexit_registered: bool = False


STATE = State()
global_process_set = ProcessSet([0])   # ranks fixed by init()


def init(comm: Union[MPI.Comm, Sequence[int], None] = None,
         process_sets: Optional[Iterable[ProcessSet]] = None) -> None:
    """Start hvdlite on every rank of ``comm`` (default: COMM_WORLD).

    Args:
        comm: an mpi4py communicator, or a list of COMM_WORLD ranks to run on.
        process_sets: ProcessSets to register right away (same list on every rank).

    A second call while running is harmless. Settings come from HVDLITE_*
    variables (see hvdlite.config). Collective: every rank of ``comm`` calls it.
    """
    with STATE.lock:
        if STATE.engine is not None:
            if STATE.engine.dead is None:
                return
            STATE.engine.shutdown()
        config = Config.load()
        _configure_logging(config)
        check_launch(MPI.COMM_WORLD.Get_size())
        engine = Engine(config, _resolve_comm(comm))
        topology = engine.start()
        STATE.config, STATE.engine, STATE.topology = config, engine, topology
        global_process_set.ranks = list(range(topology.size))
        global_process_set.process_set_id = 0
        STATE.process_sets = {0: global_process_set}
        STATE.name_counters.clear()
        if config.abort_on_error:
            failure.install(topology.rank, topology.size)
        if not STATE.atexit_registered:
            atexit.register(shutdown)
            STATE.atexit_registered = True
    from hvdlite.core.ops import add_process_set
    for process_set in process_sets or ():
        add_process_set(process_set)


def _resolve_comm(comm: Union[MPI.Comm, Sequence[int], None]) -> MPI.Comm:
    if comm is None:
        return MPI.COMM_WORLD
    if isinstance(comm, MPI.Comm):
        return comm
    ranks = sorted(int(r) for r in comm)
    if MPI.COMM_WORLD.Get_rank() not in ranks:
        raise ValueError(f"rank {MPI.COMM_WORLD.Get_rank()} called init(comm={ranks}) but "
                         "is not in that list; only the listed ranks may call it")
    return MPI.COMM_WORLD.Create_group(MPI.COMM_WORLD.Get_group().Incl(ranks))


def _configure_logging(config: Config) -> None:
    logger = logging.getLogger("hvdlite")
    logger.setLevel(config.log_level.upper())
    if not logger.handlers:
        handler = logging.StreamHandler()
        rank = MPI.COMM_WORLD.Get_rank()
        handler.setFormatter(logging.Formatter(f"[hvdlite rank {rank}] %(levelname)s: %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False


def shutdown() -> None:
    """Stop the engine. Other ranks' later collectives fail with ShutdownError."""
    with STATE.lock:
        engine, STATE.engine = STATE.engine, None
        STATE.topology = None
    if engine is not None:
        engine.shutdown()


def is_initialized() -> bool:
    return STATE.engine is not None


def engine(what: str = "this function") -> Engine:
    current = STATE.engine
    if current is None:
        raise NotInitializedError(what)
    current.raise_if_dead()
    return current


def topology(what: str) -> Topology:
    current = STATE.topology
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
    from hvdlite.core.topology import device_for_local_rank
    topo = topology("hvdlite.local_device()")
    return device_for_local_rank(topo.local_rank, topo.local_size,
                                 os.environ.get("CUDA_VISIBLE_DEVICES"))


def mpi_threads_supported() -> bool:
    topology("hvdlite.mpi_threads_supported()")
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def config() -> Config:
    if STATE.config is None:
        raise NotInitializedError("hvdlite.config()")
    return STATE.config


def next_name(kind: str) -> str:
    """Deterministic names for unnamed ops: the n-th unnamed allreduce is named
    the same on every rank that issues the same sequence of calls."""
    with STATE.lock:
        count = STATE.name_counters.get(kind, 0)
        STATE.name_counters[kind] = count + 1
    return f"{kind}.noname.{count}"


def find_process_set(process_set: Optional[ProcessSet]) -> tuple[int, ProcessSet]:
    engine("a collective")
    process_set = global_process_set if process_set is None else process_set
    set_id = process_set._require_registered()
    if set_id not in STATE.process_sets:
        raise HvdliteError(f"{process_set!r} has been removed")
    return set_id, process_set

