"""The one table of ``HVDLITE_*`` variables: name, default, parser and doc.

Every knob hvdlite reads from the environment is declared here and nowhere
else; the README's variable table is checked against this list by a test.
Values resolve as: explicit argument > environment > default. A misspelt
``HVDLITE_`` variable is reported (it would otherwise be silently ignored).
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Callable, Mapping

from hvdlite.errors import ConfigError

_log = logging.getLogger("hvdlite")

_SIZE_SUFFIXES = {"": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20,
                  "mb": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}


def parse_bytes(text: str) -> int:
    """``"65536"``, ``"64K"``, ``"64MiB"`` -> bytes (binary units)."""
    stripped = text.strip().lower()
    digits = stripped.rstrip("kmgib")
    suffix = stripped[len(digits):]
    if suffix not in _SIZE_SUFFIXES:
        raise ValueError(f"unknown size suffix {suffix!r}")
    value = int(float(digits) * _SIZE_SUFFIXES[suffix])
    if value < 0:
        raise ValueError("a size cannot be negative")
    return value


def parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("expected 1/0, true/false, yes/no or on/off")


def parse_nonneg_float(text: str) -> float:
    value = float(text)
    if value < 0:
        raise ValueError("must be >= 0")
    return value


def _choice(*allowed: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = text.strip().lower()
        if value not in allowed:
            raise ValueError(f"expected one of {', '.join(allowed)}")
        return value
    return parse


@dataclasses.dataclass(frozen=True)
class Option:
    field: str
    default: Any
    parse: Callable[[str], Any]
    doc: str

    @property
    def env(self) -> str:
        return "HVDLITE_" + self.field.upper()


OPTIONS: tuple[Option, ...] = (
    Option("cycle_time", 1.0, parse_nonneg_float,
           "Milliseconds an idle engine waits before joining a negotiation round. "
           "Work submitted locally wakes the engine at once, so this bounds only how "
           "long a rank with work waits for an idle peer, and the idle CPU cost."),
    Option("fusion_threshold", 64 << 20, parse_bytes,
           "Bytes of same-dtype allreduce tensors packed into one fused reduction "
           "(the persistent fusion buffer's size). 0 disables fusion."),
    Option("allreduce", "auto", _choice("auto", "mpi", "ring"),
           "Allreduce backend: 'mpi' (MPI_Allreduce), 'ring' (hvdlite's ring over "
           "point-to-point with persistent buffers) or 'auto' (mpi below "
           "HVDLITE_RING_THRESHOLD bytes, ring from there on)."),
    Option("ring_threshold", 2 << 20, parse_bytes,
           "With HVDLITE_ALLREDUCE=auto, reductions of at least this many bytes use "
           "the ring. Chosen from `python -m hvdlite.bench allreduce` on 2 cores."),
    Option("ring_chunk", 256 << 10, parse_bytes,
           "Bytes per message in the ring; large segments are pipelined in chunks of "
           "this size so the reduction of one chunk overlaps the transfer of the next."),
    Option("cache_capacity", 1024, int,
           "Negotiated responses remembered per process set. A step whose tensors "
           "are all cached is agreed with one small bit-vector allreduce instead of "
           "a gather and a broadcast."),
    Option("stall_check_time", 60.0, parse_nonneg_float,
           "Seconds a tensor may wait for other ranks before rank 0 logs it with the "
           "ranks that have not submitted it. 0 disables the check."),
    Option("stall_shutdown_time", 0.0, parse_nonneg_float,
           "If > 0, a tensor stalled this many seconds becomes a StallError on every "
           "rank and hvdlite stops, instead of waiting forever."),
    Option("timeline", "", str,
           "Path of a Chrome-trace JSON file that rank 0 writes with negotiate, queue, "
           "memcpy and collective spans per tensor (open in chrome://tracing or "
           "Perfetto). Empty disables."),
    Option("log_level", "warning", _choice("debug", "info", "warning", "error"),
           "Level of the 'hvdlite' logger."),
    Option("abort_on_error", True, parse_bool,
           "On an uncaught exception in any rank, print its traceback once and abort "
           "the whole MPI job, so no other rank is left hanging in a collective."),
    Option("spin_time", 100.0, parse_nonneg_float,
           "Microseconds the engine busy-polls a pending negotiation before it "
           "starts sleeping between polls (lower latency vs. CPU left to compute)."),
    Option("peer_timeout", 20.0, parse_nonneg_float,
           "Seconds a negotiation round may wait on a rank that does not answer before "
           "every other rank fails with PeerLostError naming it (a frozen, stopped or "
           "unreachable process). A rank whose process has ended is reported within "
           "about a second when it ran on the same host. 0 disables the timeout (ended "
           "processes are still reported)."),
    Option("exit_guard", True, parse_bool,
           "Under MPICH's hydra launcher, keep each rank's launcher connection open "
           "for a while after its process ends (one small helper process per rank), so "
           "that a rank ending without MPI_Finalize (os._exit, killed) is reported by "
           "the others as PeerLostError and the job fails, instead of hydra silently "
           "killing every rank and exiting 0."),
)

_BY_FIELD = {option.field: option for option in OPTIONS}


def _load(cls: type, environ: Mapping[str, str] | None = None, **overrides: Any) -> Any:
    """Resolve every option: explicit override > environment > default."""
    environ = os.environ if environ is None else environ
    _warn_unknown(environ)
    values: dict[str, Any] = {}
    for option in OPTIONS:
        if overrides.get(option.field) is not None:
            values[option.field] = overrides.pop(option.field)
        elif option.env in environ:
            values[option.field] = _parse(option, environ[option.env])
        else:
            values[option.field] = option.default
    if overrides:
        raise ConfigError(f"unknown hvdlite option(s): {', '.join(sorted(overrides))}")
    return cls(**values)


# The dataclass is generated from OPTIONS so that each knob is defined exactly once.
Config = dataclasses.make_dataclass(
    "Config",
    [(o.field, type(o.default), dataclasses.field(default=o.default)) for o in OPTIONS],
    namespace={"load": classmethod(_load),
               "__doc__": "Resolved hvdlite settings; see OPTIONS for each field."},
)


def _parse(option: Option, raw: str) -> Any:
    try:
        return option.parse(raw)
    except ValueError as exc:
        raise ConfigError(f"{option.env}={raw!r} is invalid: {exc}. {option.doc}") from None


def _warn_unknown(environ: Mapping[str, str]) -> None:
    known = {option.env for option in OPTIONS}
    for name in environ:
        if name.startswith("HVDLITE_") and name not in known:
            _log.warning("ignoring unknown environment variable %s; known: %s",
                         name, ", ".join(sorted(known)))
