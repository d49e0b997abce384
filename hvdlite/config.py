"""The one table of ``HVDLITE_*`` variables: name, default, parser and doc.

Every knob hvdlite reads from the environment is declared here and nowhere
else; the configuration page (docs/configuration.md) is generated from this list.
Values resolve as: explicit argument > environment > default. A misspelt
``HVDLITE_`` variable is reported (it would otherwise be silently ignored).

Knobs with a Horovod equivalent also accept Horovod's variable
(``HOROVOD_FUSION_THRESHOLD``, ``HOROVOD_TIMELINE``...), which Horovod scripts and
job files set; the ``HVDLITE_`` one wins where both are set (a warning names both
when their values differ), since it can only have been meant for hvdlite while a
job file may set Horovod's for every framework it runs. ``hvdlite.horovod_env``
converts the values whose form differs and says why the other ``HOROVOD_*``
variables are ignored (each warned about once per process).

A knob that replaced older ones still reads their variables (``deprecated``),
with a warning naming the variable to set instead.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, Optional

from hvdlite import horovod_env
from hvdlite.config_environ import checked, from_environment, warn_unknown
from hvdlite.config_values import (  # noqa: F401  (also importable from here)
    OWN,
    SAME,
    SET,
    Agreement,
    Option,
    knob,
    parse_bytes,
    parse_bucket_bytes,
    parse_bool,
    parse_nonneg_float,
    parse_nonneg_int,
    parse_positive_int,
    parse_backends,
    _choice)
from hvdlite.errors import ConfigError

@dataclasses.dataclass(frozen=True)
class Config:
    """Resolved hvdlite settings, read once by ``init()``; each field is ``HVDLITE_<FIELD>``.

    Frozen: the engine reads it from its own thread, so a setting changes only by
    a negotiated reconfiguration that replaces the object on every rank at the
    same point in the order of collectives (``hvdlite.api.control.reconfigure``).
    """
    cycle_time: float = knob(
        1.0, parse_nonneg_float, SAME,
        "With process sets besides the world: milliseconds an idle engine waits "
        "before joining a negotiation round while any rank has work; once every rank "
        "is idle, the wait doubles each round, up to 64 cycles and 0.1 s. It bounds "
        "how long a rank with work on a set waits for an idle peer outside it. While "
        "the world is the only set, nobody waits on an idle rank's rounds, and it joins "
        "one every 0.1 s (0.4 s on the torch transport, where a round costs more CPU), "
        "or every cycle if that is longer. Work submitted locally wakes the engine at "
        "once.",
        aliases=("HOROVOD_CYCLE_TIME",))
    fusion_threshold: int = knob(
        64 << 20, parse_bytes, SAME,
        "Bytes of same-dtype allreduce tensors packed into one fused reduction "
        "(the persistent fusion buffer's size). 0 disables fusion.",
        aliases=("HOROVOD_FUSION_THRESHOLD",))
    direct_threshold: int = knob(
        1 << 20, parse_bytes, SAME,
        "Allreduce tensors of at least this many bytes are never packed into the "
        "fusion buffer: each is reduced alone, in place in its own memory. Fusion "
        "amortizes per-op latency over small tensors; for large ones the two copies "
        "in and out of the buffer cost more than the latency saved (measured on the "
        "MLP benchmark: packing 7.4 MB of gradients cost ~1.5 ms of CPU per step).")
    output_pool: int = knob(
        256 << 20, parse_bytes, OWN,
        "Bytes of idle memory kept for recycling the outputs of out = allreduce(x) "
        "on the CPU (outputs of 1 MiB and more). A fresh large output page-faults "
        "on every 4 KiB while it is written, which costs as much as a fast "
        "allreduce; a loop that drops last step's output reuses its memory. "
        "0 allocates every output anew.")
    allreduce: str = knob(
        "auto", _choice("auto", "mpi", "ring", "ps"), SAME,
        "Allreduce backend: 'mpi' (MPI_Allreduce), 'ring' (hvdlite's ring over "
        "point-to-point with persistent buffers), 'auto' (mpi below "
        "HVDLITE_RING_THRESHOLD bytes, ring from there on) or 'ps' (parameter "
        "server: every rank sends its buffer to the process set's rank 0, which "
        "reduces and sends the result back; for comparison, never faster).")
    shared_memory: bool = knob(
        True, parse_bool, SAME,
        "Under torchrun, where every rank of a process set is on one x86-64 Linux host, "
        "allreduce host data through the node's shared memory (anonymous, 4 MiB per rank "
        "and set) instead of Gloo's TCP over loopback, which took 2.4-3.6 times as long "
        "as MPICH (BENCHMARKS.md). The ranks fall back to Gloo together, logged by rank 0, "
        "where they span hosts or a segment cannot be made or opened; 0 always uses Gloo. "
        "MPI libraries use the node's memory on their own.")
    gpu_allreduce: str = knob(
        "nccl", _choice("nccl", "mpi"), SAME,
        "How GPU tensors are reduced and moved: 'nccl' (NCCL on the GPUs, where the "
        "process set has one GPU per rank: CuPy's under MPI, torch's under torchrun; sets "
        "whose ranks share a GPU fall back to staging) or 'mpi' (copies through pinned host "
        "memory and the HVDLITE_ALLREDUCE backend; under torchrun, Gloo). Without NCCL, "
        "GPU tensors are always staged.")
    backends: str = knob(
        "", parse_backends, SAME,
        "Backends asked first, by name, per device type, as torch's 'cpu:gloo,cuda:nccl': "
        "'cpu:mine,cuda:nccl' asks 'mine' first for host tensors; a bare name, for every "
        "device type it serves. The rest of each device's chain follows (registered "
        "backends, then the built-in ones). init() raises UnknownBackendError on every rank "
        "for a name not registered with hvdlite.backends.register_backend.")
    bucket_bytes: int = knob(
        25 << 20, parse_bucket_bytes, SAME,
        "The size of DistributedOptimizer's gradient buckets (torch, TensorFlow, Keras; "
        "CPU and GPU), as DDP's bucket_cap_mb: parameters are laid out in reverse "
        "registration order in flat buckets of about this many bytes, the first one 1 MiB "
        "so communication starts early, and each bucket is reduced in place by one "
        "request (torch's .grad are views of the buckets: no packing copies). 'all': one "
        "bucket of each kind, reduced once backward is done (no overlap, the fewest "
        "rounds); the default where a node's ranks outnumber its CPUs and compute on them "
        "(hvdlite.policy.defaults). 0 gives every gradient a bucket of its own (one request "
        "per gradient, for comparison).",
        deprecated=("HVDLITE_GPU_BUCKET_BYTES",))
    one_rank_shortcut: bool = knob(
        True, parse_bool, SAME,
        "On a process set of one rank a gradient is its own average, so "
        "DistributedOptimizer (torch, TensorFlow, Keras) sends nothing and a one-GPU "
        "run of a distributed script pays nothing per step. 0 turns that shortcut "
        "off: every gradient then goes through the engine, the buckets and the "
        "backend (NCCL on a GPU) exactly as on several ranks, so one GPU can test the "
        "multi-GPU path (make gpu-check and the GPU bucket tests use it).")
    lane: bool = knob(
        True, parse_bool, SAME,
        "Gradient buckets of an agreed layout (DistributedOptimizer, the gradient tapes; "
        "float32 and float64 on the CPU) are reduced on a lane of their own, with no "
        "negotiation round per step: each bucket carries check words that make ranks "
        "out of step a MismatchError on every rank. 0 negotiates every bucket as any "
        "other request. ZeroRedundancyOptimizer's chunks (float32 and float64 on the "
        "CPU) go on lanes of their own too where the transport has them (MPI), "
        "reduce-scattered and allgathered with no round.")
    ring_threshold: int = knob(
        2 << 20, parse_bytes, SAME,
        "With HVDLITE_ALLREDUCE=auto, reductions of at least this many bytes use "
        "the ring. Chosen from `python -m bench allreduce` on 2 cores, a core per "
        "rank. Unset, it is never (MPI's Allreduce at every size) where a node's ranks "
        "outnumber its CPUs and compute on them (hvdlite.policy.defaults).")
    ring_chunk: int = knob(
        256 << 10, parse_bytes, SAME,
        "Bytes per message in the ring; large segments are pipelined in chunks of "
        "this size so the reduction of one chunk overlaps the transfer of the next.")
    cache_capacity: int = knob(
        1024, parse_nonneg_int, SAME,
        "Negotiated responses remembered per process set. A step whose tensors "
        "are all cached is agreed with one small bit-vector allreduce instead of "
        "a gather and a broadcast.",
        aliases=("HOROVOD_CACHE_CAPACITY",))
    stall_check_time: float = knob(
        60.0, parse_nonneg_float, SAME,
        "Seconds a tensor may wait for other ranks before rank 0 logs it with the "
        "ranks that have not submitted it. A deadlock (every rank blocked in hvdlite on "
        "collectives another rank has not submitted) is a DeadlockError on every rank "
        "after half of it. 0 disables both.",
        aliases=("HOROVOD_STALL_CHECK_DISABLE", "HOROVOD_STALL_CHECK_TIME_SECONDS"))
    stall_shutdown_time: float = knob(
        0.0, parse_nonneg_float, SAME,
        "If > 0, a tensor stalled this many seconds becomes a StallError on every "
        "rank and hvdlite stops, instead of waiting forever.",
        aliases=("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS",))
    timeline: str = knob(
        "", str, OWN,
        "Path of a Chrome-trace JSON file that rank 0 writes, in the layout and with the "
        "event names of Horovod's timeline: a row per tensor, NEGOTIATE_ALLREDUCE, "
        "ALLREDUCE with QUEUE, MEMCPY_IN_FUSION_BUFFER, MPI_ALLREDUCE (the backend's "
        "name), MEMCPY_OUT_FUSION_BUFFER inside (open in chrome://tracing or Perfetto). "
        "Empty disables; DYNAMIC (Horovod's value) writes nothing until "
        "hvd.start_timeline(path).",
        aliases=("HOROVOD_TIMELINE",))
    timeline_mark_cycles: bool = knob(
        False, parse_bool, OWN,
        "With a timeline, mark the start of every engine cycle (a CYCLE_START event) "
        "to see how ops fall into negotiation cycles. Busy cycles are frequent: "
        "the trace grows fast.",
        aliases=("HOROVOD_TIMELINE_MARK_CYCLES",))
    report: str = knob(
        "", str, SET,
        "Directory where rank 0 writes report.json, report.txt and report.png at "
        "shutdown: per rank step time, compute, time blocked on communication, time "
        "waiting for slower peers, bytes moved and peak memory, the stragglers and "
        "a verdict (see 'Why is my training slow?'). Empty disables recording.")
    output_check: str = knob(
        "error", _choice("error", "warn"), SAME,
        "What init() does when an output hvdlite will write (the HVDLITE_REPORT "
        "directory, the HVDLITE_TIMELINE file, HVDLITE_ELASTIC_DIR, the "
        "HVDLITE_AUTOTUNE_LOG file) cannot be written "
        "by rank 0: 'error' raises OutputPathError on every rank before any training; "
        "'warn' logs it and goes on (that output then fails when it is written).")
    log_level: str = knob(
        "warning", _choice("debug", "info", "warning", "error"), OWN,
        "Level of the 'hvdlite' logger.",
        aliases=("HOROVOD_LOG_LEVEL",))
    abort_on_error: bool = knob(
        True, parse_bool, OWN,
        "On an uncaught exception in any rank, print its traceback once and abort "
        "the whole MPI job, so no other rank is left hanging in a collective.")
    spin_time: float = knob(
        100.0, parse_nonneg_float, OWN,
        "Microseconds the engine busy-polls a pending negotiation or reduction, while a "
        "thread waits on a result, before it sleeps between polls (lower latency vs. CPU "
        "left to compute). The default where every rank that computes on the CPU has a "
        "CPU of its own (a waiting thread leaves it idle) is 5000.")

    peer_timeout: float = knob(
        20.0, parse_nonneg_float, OWN,
        "Seconds the ranks wait on a rank that does not answer, whether they negotiate "
        "or are inside a data collective with it, before every other rank fails with "
        "PeerLostError naming it (a frozen, stopped or unreachable process). A rank "
        "whose process has ended is reported within "
        "about a second when it ran on the same host, also in the middle of a data "
        "collective. 0 disables the timeout (ended "
        "processes are still reported).")
    exit_guard: bool = knob(
        True, parse_bool, OWN,
        "Under MPICH's hydra launcher, keep each rank's launcher connection open "
        "for a while after its process ends (one small helper process per rank), so "
        "that a rank ending without MPI_Finalize (os._exit, killed) is reported by "
        "the others as PeerLostError and the job fails, instead of hydra silently "
        "killing every rank and exiting 0. The helper also holds the rank's stdout and "
        "stderr until the other ranks on its host have ended, or for 5 s: otherwise hydra "
        "kills every rank as soon as it sees one killed by a signal, before any could "
        "report which rank was lost.")

    elastic_dir: str = knob(
        "", str, SET,
        "Directory where hvd.elastic.run keeps the committed state: rank 0 writes it "
        "atomically on commit() (temporary file, fsync, rename) and a restarted job "
        "resumes from it; a write that fails raises StateWriteError on every rank at that "
        "commit. hvdliterun --elastic sets a fresh one per launch; the SLURM "
        "elastic template one per job id. Empty: commits stay in memory only.")
    elastic_persist_every: int = knob(
        1, parse_positive_int, SAME,
        "With HVDLITE_ELASTIC_DIR set, write every n-th commit() to disk (the others "
        "stay in memory). A preempted job always writes its last commit.")
    elastic_trust_dir: bool = knob(
        False, parse_bool, OWN,
        "Load the committed state even where HVDLITE_ELASTIC_DIR or its file is owned by "
        "another user or is group- or world-writable (refused by default, as ssh refuses "
        "such keys: whoever can write there could make every rank run their code).")

    autotune: bool = knob(
        False, parse_bool, SAME,
        "Measure instead of trusting defaults: during the first steps of training every "
        "rank runs the same candidate settings (the size from which the ring replaces "
        "MPI's Allreduce, the ring's chunk, the engine's spin and cycle times, the fusion "
        "and direct thresholds where tensors are packed), a few optimizer steps each, "
        "scores each by the slowest rank's median step time, and keeps the fastest; "
        "rank 0 decides and every rank switches at the same step boundary. Settings "
        "given explicitly are not tuned. Step boundaries come from the DistributedOptimizer "
        "(torch, Keras) or hvd.step_done().",
        aliases=("HOROVOD_AUTOTUNE",))
    autotune_log: str = knob(
        "", str, OWN,
        "With HVDLITE_AUTOTUNE, the CSV file rank 0 writes every trial to (its settings, "
        "steps and step time per rank) and, last, the choice and why. Checked at init() "
        "like the other outputs. Empty: no log (the report still shows the choice).",
        aliases=("HOROVOD_AUTOTUNE_LOG",))
    autotune_warmup_steps: int = knob(
        3, parse_nonneg_int, SAME,
        "With HVDLITE_AUTOTUNE, optimizer steps before the first trial: the first steps "
        "build the gradient buckets and fault in buffers, and are slower than the rest.")
    autotune_steps_per_sample: int = knob(
        5, parse_positive_int, SAME,
        "With HVDLITE_AUTOTUNE, the fewest optimizer steps timed per trial (after one "
        "untimed step following each switch); more when steps are short, so that a trial "
        "lasts at least 0.25 s (decided once, on rank 0, from the warm-up steps).")

    @property
    def timeline_path(self) -> str:
        """The file rank 0 writes the timeline to from init() on ('' for none): the
        path HVDLITE_TIMELINE or else HOROVOD_TIMELINE names, unless it is DYNAMIC."""
        return "" if self.timeline == TIMELINE_DYNAMIC else self.timeline

    @classmethod
    def load(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> "Config":
        """Resolve every option: explicit override > environment (HVDLITE_*, then
        Horovod's alias) > default."""
        environ = os.environ if environ is None else environ
        warn_unknown(environ, OPTIONS)
        horovod_env.warn_ignored(environ, HOROVOD_ALIASES)
        values: dict[str, Any] = {}
        for option in OPTIONS:
            if overrides.get(option.field) is not None:
                values[option.field] = checked(option, overrides.pop(option.field))
            elif (found := from_environment(option, environ)) is not None:
                values[option.field] = found
        if overrides:
            raise ConfigError(f"unknown hvdlite option(s): {', '.join(sorted(overrides))}")
        return cls(**values)

    def replace(self, **changes: Any) -> "Config":
        """A copy with some fields changed; unknown names and values their variable
        would refuse raise ConfigError."""
        options = {option.field: option for option in OPTIONS}
        unknown = sorted(set(changes) - set(options))
        if unknown:
            raise ConfigError(f"unknown hvdlite option(s): {', '.join(unknown)}")
        return dataclasses.replace(self, **{name: checked(options[name], value)
                                            for name, value in changes.items()})


# HVDLITE_TIMELINE / HOROVOD_TIMELINE value: hvd.start_timeline() later, no file now.
TIMELINE_DYNAMIC = "DYNAMIC"

# The table every consumer reads (the README check, the launcher, load()).
OPTIONS: tuple[Option, ...] = tuple(
    Option(f.name, f.default, f.metadata["parse"], f.metadata["doc"], f.metadata["agreement"],
           f.metadata["aliases"], f.metadata["deprecated"])
    for f in dataclasses.fields(Config))
# Horovod's variables that set an hvdlite knob (the other HOROVOD_* are ignored, with a warning).
HOROVOD_ALIASES = frozenset(name for option in OPTIONS for name in option.aliases)


def fields_set(environ: Optional[Mapping[str, str]] = None) -> frozenset[str]:
    """The fields the environment sets (through HVDLITE_*, a Horovod alias or an old
    name): the user's own choices, which topology-aware defaults and autotune leave
    alone."""
    return frozenset(sources(environ))


def sources(environ: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """field -> ``VARIABLE='text'`` for each field the environment sets, naming the
    variable its value is read from (HVDLITE_*, else a Horovod alias, else an old name)."""
    environ = os.environ if environ is None else environ
    found = {}
    for option in OPTIONS:
        name = next((n for n in (option.env, *option.aliases, *option.deprecated)
                     if n in environ), None)
        if name is not None:
            found[option.field] = f"{name}={environ[name]!r}"
    return found
