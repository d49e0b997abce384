"""Horovod's ``HOROVOD_*`` variables, which job files and images set for Horovod:
how the ones with a meaning here become hvdlite settings, and why the others
are ignored.

Each variable Horovod reads at run time (``horovod/common/common.h``,
``operations.cc``, ``logging.cc``, ``utils/env_parser.cc``, its Python runner) is
either an alias of an ``HVDLITE_`` knob (declared in ``hvdlite.config``; its value
converted here where Horovod's differs in form) or listed in ``IGNORED`` with the
reason. ``warn_ignored`` (called by ``Config.load``) warns once per process about
an ignored variable that is set, unless its value asks for nothing or for what
hvdlite does anyway, and about any other ``HOROVOD_`` variable (Horovod's build
settings, such as ``HOROVOD_WITH_PYTORCH``).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import re
from typing import Callable, Collection, Mapping, Optional

_log = logging.getLogger("hvdlite")


_WORDS = {"true": True, "yes": True, "on": True, "false": False, "no": False, "off": False,
          "": False}


def _switch_value(text: str) -> bool:
    """Horovod's on/off switch: an integer, on above 0 (Horovod reads it with C's strtol),
    or one of hvdlite's boolean words (empty is off). Horovod would read anything else as
    whatever number it starts with, "maybe" and "true" as off: here that is a ValueError,
    not a guess."""
    stripped = text.strip()
    if stripped.lower() in _WORDS:
        return _WORDS[stripped.lower()]
    if re.fullmatch(r"[+-]?\d+", stripped):
        return int(stripped) > 0
    raise ValueError("expected an integer (above 0 is on, as Horovod reads it) or "
                     "true/false, yes/no, on/off")


def _reads_as(state: bool) -> Callable[[str], bool]:
    """Whether the value is a switch in ``state`` (an unreadable one is in neither, so the
    warning about an ignored variable is given)."""
    def reads(text: str) -> bool:
        try:
            return _switch_value(text) is state
        except ValueError:
            return False
    return reads


_off, _on = _reads_as(False), _reads_as(True)


def _is_mpi(text: str) -> bool:
    return text.strip().lower() == "mpi"


def _always(text: str) -> bool:
    return True


def _never(text: str) -> bool:
    return False


# -- aliases whose value converts (the others are read as the HVDLITE_ variable's) ---------
def _stall_check_disable(text: str) -> Optional[str]:
    """On: HVDLITE_STALL_CHECK_TIME=0 (no check). Off: sets nothing, so
    HOROVOD_STALL_CHECK_TIME_SECONDS, if set, decides (as in Horovod, where the
    switch wins over the time)."""
    return "0" if _switch_value(text) else None


_LOG_LEVELS = {"trace": "debug", "fatal": "error"}   # Horovod's levels hvdlite lacks


def _log_level(text: str) -> str:
    """Horovod's levels, any case: trace is debug here, fatal is error."""
    lowered = text.strip().lower()
    return _LOG_LEVELS.get(lowered, lowered)


def _switch(text: str) -> str:
    """Horovod's on/off switch as hvdlite's boolean."""
    return "1" if _switch_value(text) else "0"


CONVERSIONS: dict[str, Callable[[str], Optional[str]]] = {
    "HOROVOD_STALL_CHECK_DISABLE": _stall_check_disable,
    "HOROVOD_AUTOTUNE": _switch,
    "HOROVOD_TIMELINE_MARK_CYCLES": _switch,
    "HOROVOD_LOG_LEVEL": _log_level,
}


def convert(variable: str, text: str) -> Optional[str]:
    """Horovod's ``variable=text`` as the text of the hvdlite variable it sets; None
    where this value sets nothing. Raises ValueError for a value it cannot read."""
    return CONVERSIONS.get(variable, str)(text)


# -- variables without a meaning here ---------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Ignored:
    why: str
    # Values that ask for nothing (a switch left at Horovod's default) or for what hvdlite
    # does anyway: no warning.
    quiet: Callable[[str], bool] = _never


_NOT_BAYESIAN = Ignored("hvdlite's autotune (HOROVOD_AUTOTUNE) searches one setting at a "
                        "time, not by Bayesian optimisation: nothing to set")
_GPU_BUILD = Ignored("a setting of Horovod's build; hvdlite chooses how GPU tensors move "
                     "at run time, with HVDLITE_GPU_ALLREDUCE")
_NO_GLOO = Ignored("hvdlite's Gloo is torch.distributed's, under torchrun (or hvdliterun "
                   "--gloo): its rendezvous and timeouts are torchrun's options")


def _set_by_hvdliterun_gloo(text: str) -> bool:
    """hvdliterun --gloo sets Horovod's launcher variables for every rank, from torchrun's
    (hvdlite.runner.gloo): there they say what hvdlite knows already."""
    return "TORCHELASTIC_RUN_ID" in os.environ


_LAUNCHER = Ignored("set by horovodrun for its own processes; hvdlite takes ranks and "
                    "hosts from its transport (MPI, or torchrun), and hvdliterun launches "
                    "jobs", _set_by_hvdliterun_gloo)

IGNORED: dict[str, Ignored] = {
    "HOROVOD_HIERARCHICAL_ALLREDUCE": Ignored(
        "hvdlite has no hierarchical allreduce; HVDLITE_ALLREDUCE chooses the algorithm", _off),
    "HOROVOD_HIERARCHICAL_ALLGATHER": Ignored("hvdlite has no hierarchical allgather", _off),
    "HOROVOD_TORUS_ALLREDUCE": Ignored(
        "hvdlite has no torus allreduce; HVDLITE_ALLREDUCE chooses the algorithm", _off),
    "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": Ignored(
        "Horovod discards whole samples; hvdlite's warm-up is counted in optimizer steps: "
        "set HVDLITE_AUTOTUNE_WARMUP_STEPS"),
    "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": Ignored(
        "Horovod counts engine cycles per sample; hvdlite times optimizer steps: set "
        "HVDLITE_AUTOTUNE_STEPS_PER_SAMPLE"),
    "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": _NOT_BAYESIAN,
    "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE": _NOT_BAYESIAN,
    "HOROVOD_CPU_OPERATIONS": Ignored(
        "hvdlite's CPU collectives always run on MPI (HVDLITE_ALLREDUCE chooses the "
        "algorithm)", _is_mpi),
    "HOROVOD_CONTROLLER": Ignored("hvdlite's ranks always coordinate over MPI", _is_mpi),
    "HOROVOD_GPU_OPERATIONS": _GPU_BUILD,
    "HOROVOD_GPU_ALLREDUCE": _GPU_BUILD,
    "HOROVOD_GPU_ALLGATHER": _GPU_BUILD,
    "HOROVOD_GPU_BROADCAST": _GPU_BUILD,
    "HOROVOD_GPU_ALLTOALL": _GPU_BUILD,
    "HOROVOD_GPU_REDUCESCATTER": _GPU_BUILD,
    "HOROVOD_MPI_THREADS_DISABLE": Ignored(
        "hvdlite's engine thread needs MPI at the serialized thread level or above "
        "(mpi4py.rc.thread_level chooses it)", _off),
    "HOROVOD_NUM_NCCL_STREAMS": Ignored("hvdlite's NCCL stream count is not configurable"),
    "HOROVOD_BATCH_D2D_MEMCOPIES": Ignored("not configurable in hvdlite"),
    "HOROVOD_THREAD_AFFINITY": Ignored("hvdlite does not pin its engine thread"),
    "HOROVOD_DISABLE_GROUP_FUSION": Ignored("not configurable in hvdlite", _off),
    "HOROVOD_DISABLE_NVTX_RANGES": Ignored("hvdlite emits no NVTX ranges", _on),
    "HOROVOD_ENABLE_ASYNC_COMPLETION": Ignored("not configurable in hvdlite", _off),
    "HOROVOD_ENABLE_XLA_OPS": Ignored("hvdlite's collectives cannot run inside XLA", _off),
    "HOROVOD_ADASUM_MPI_CHUNK_SIZE": Ignored("not configurable in hvdlite"),
    "HOROVOD_DYNAMIC_PROCESS_SETS": Ignored(
        "process sets can always be added after init() in hvdlite", _always),
    "HOROVOD_LOG_HIDE_TIME": Ignored("hvdlite's log lines carry no time", _on),
    "HOROVOD_CCL_CACHE": Ignored("hvdlite has no oneCCL"),
    "HOROVOD_GLOO_IFACE": _NO_GLOO,
    "HOROVOD_GLOO_TIMEOUT_SECONDS": _NO_GLOO,
    "HOROVOD_GLOO_RENDEZVOUS_ADDR": _NO_GLOO,
    "HOROVOD_GLOO_RENDEZVOUS_PORT": _NO_GLOO,
    "HOROVOD_ELASTIC": Ignored("an elastic hvdlite job is started by hvdliterun --elastic", _off),
    "HOROVOD_ELASTIC_TIMEOUT": _LAUNCHER,
    "HOROVOD_START_TIMEOUT": _LAUNCHER,
    "HOROVOD_SECRET_KEY": _LAUNCHER,
    "HOROVOD_HOSTNAME": _LAUNCHER,
    "HOROVOD_RANK": _LAUNCHER,
    "HOROVOD_SIZE": _LAUNCHER,
    "HOROVOD_LOCAL_RANK": _LAUNCHER,
    "HOROVOD_LOCAL_SIZE": _LAUNCHER,
    "HOROVOD_CROSS_RANK": _LAUNCHER,
    "HOROVOD_CROSS_SIZE": _LAUNCHER,
}

_OTHER = Ignored("hvdlite does not read it (a setting of Horovod's build, its Spark "
                 "integration, or not Horovod's)")


def why_ignored(variable: str, text: str) -> Optional[str]:
    """Why ``variable=text`` (a HOROVOD_ variable that is no alias) changes nothing
    here; None where its value asks for what hvdlite does anyway."""
    entry = IGNORED.get(variable, _OTHER)
    return None if entry.quiet(text) else entry.why


# HOROVOD_* variables already reported as ignored: once per process, not at every
# init() (elastic restarts and tests call it again).
_WARNED: set[str] = set()


# Where launchers put a process's rank (MPICH's hydra, Open MPI, PMIx, torchrun, srun):
# read before init(), when hvdlite does not know its rank yet.
_RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "RANK", "SLURM_PROCID")


def _launcher_rank(environ: Mapping[str, str]) -> Optional[int]:
    for variable in _RANK_VARIABLES:
        if environ.get(variable, "").isdigit():
            return int(environ[variable])
    return None


def warn_ignored(environ: Mapping[str, str], aliases: Collection[str]) -> None:
    """Warn about each HOROVOD_* variable that is set and changes nothing here
    (``aliases``, read as hvdlite settings, are not). Only the launcher's rank 0 (or a
    process no launcher numbered) warns: every rank has the same job file's variables,
    and N copies of one warning bury the output."""
    if _launcher_rank(environ) not in (None, 0):
        return
    for name in sorted(environ):
        if not name.startswith("HOROVOD_") or name in aliases or name in _WARNED:
            continue
        why = why_ignored(name, environ[name])
        if why is not None:
            _WARNED.add(name)
            _log.warning("ignoring %s=%r: %s", name, environ[name], why)
