"""What ``hvdlite.config`` declares its knobs with: the parsers that read a setting's text
(each raises ValueError with what it expected; ``Config.load`` turns that into a
ConfigError naming the variable and its value), what ranks must share of it
(``Agreement``), and the declaration itself (``knob``, ``Option``)."""
from __future__ import annotations

import dataclasses
import enum
import math
import re
from typing import Any, Callable

_SIZE_SUFFIXES = {"": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20,
                  "mb": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}


def parse_bytes(text: str) -> int:
    """``"65536"``, ``"64K"``, ``"64MiB"`` -> bytes (binary units)."""
    stripped = text.strip().lower()
    digits = stripped.rstrip("kmgib")
    suffix = stripped[len(digits):]
    if suffix not in _SIZE_SUFFIXES:
        raise ValueError(f"unknown size suffix {suffix!r}")
    number = float(digits)
    if not math.isfinite(number):   # int() of it would raise OverflowError, not ValueError
        raise ValueError("a size must be a finite number")
    value = int(number * _SIZE_SUFFIXES[suffix])
    if value < 0:
        raise ValueError("a size cannot be negative")
    return value


# A byte setting's "no bound": 2^62 bytes, beyond any buffer or model, and an int, as every
# other byte setting. HVDLITE_RING_THRESHOLD's "never" (hvdlite.policy.defaults.NO_RING) and
# HVDLITE_BUCKET_BYTES=all (ONE_BUCKET): one bucket of each kind (dtype and device), its
# first one not made small either, so a step's gradients are reduced once backward is done.
UNBOUNDED_BYTES = 1 << 62
ONE_BUCKET = UNBOUNDED_BYTES


def parse_bucket_bytes(text: str) -> int:
    """``"all"`` -> ONE_BUCKET; otherwise bytes, as ``parse_bytes``."""
    if text.strip().lower() == "all":
        return ONE_BUCKET
    return parse_bytes(text)


def parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("expected 1/0, true/false, yes/no or on/off")


def parse_nonneg_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value < 0:    # nan and inf: timers that never fire
        raise ValueError("must be a finite number >= 0")
    return value


def parse_nonneg_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError("must be >= 0")
    return value


def parse_positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError("must be >= 1")
    return value


def parse_backends(text: str) -> str:
    """HVDLITE_BACKENDS: comma-separated ``name`` or ``device:name`` (names are checked
    against the backend registry at init)."""
    items = [item.strip().lower() for item in text.split(",") if item.strip()]
    bad = [item for item in items if not re.fullmatch(r"([^:]+:)?[^:]+", item)]
    if bad:
        raise ValueError(f"{bad[0]!r} is not a backend name or device:name")
    return ",".join(items)


def _choice(*allowed: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = text.strip().lower()
        if value not in allowed:
            raise ValueError(f"expected one of {', '.join(allowed)}")
        return value
    return parse


class Agreement(enum.Enum):
    """What every rank's value of a setting must have in common, checked by ``init()``
    (``hvdlite.policy.settings_agreement``). Every knob declares one."""
    # It shapes the collectives (the layout, the negotiation, the backend chain): ranks
    # that differ would wait on collectives the others never start. A ConfigError.
    SAME = "the same value on every rank"
    # Whether it is set decides collectives (rank 0 gathers the report at shutdown,
    # writes the elastic state at commits); its value is used on rank 0 only.
    SET = "set on every rank or on none"
    # Each rank's own (a log level, a path only rank 0 writes): a difference is warned about.
    OWN = "may differ between ranks"


SAME, SET, OWN = Agreement.SAME, Agreement.SET, Agreement.OWN


@dataclasses.dataclass(frozen=True)
class Option:
    """One knob: its Config field, default, parser, documentation and what ranks must agree on."""
    field: str
    default: Any
    parse: Callable[[str], Any]
    doc: str
    agreement: Agreement

    # Horovod's names for it, read when HVDLITE_* is unset; the first set that sets
    # something wins (hvdlite.horovod_env converts their values).
    aliases: tuple[str, ...] = ()
    deprecated: tuple[str, ...] = ()   # hvdlite's old names for it, read with a warning

    @property
    def env(self) -> str:
        return "HVDLITE_" + self.field.upper()


def knob(default: Any, parse: Callable[[str], Any], agreement: Agreement, doc: str,
          aliases: tuple[str, ...] = (), deprecated: tuple[str, ...] = ()) -> Any:
    """A Config field that carries its parser, what ranks must agree on and its doc; the
    variable name is derived."""
    if not isinstance(agreement, Agreement):
        raise TypeError(f"a knob's agreement is an Agreement, not {agreement!r}")
    return dataclasses.field(default=default, metadata={
        "parse": parse, "doc": doc, "agreement": agreement, "aliases": aliases,
        "deprecated": deprecated})
