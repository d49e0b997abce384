"""Every rank's settings compared at ``init()``, as each rank resolved them.

Each knob of ``hvdlite.config`` declares what ranks must have in common
(``Agreement``). A setting that shapes the collectives and differs between ranks
would not fail where it is read: the ranks lay out buckets, pack fusion buffers or
pick backends differently and then wait on collectives the others never start,
which surfaces much later as a deadlock with nothing pointing at the setting. So
``init()`` compares them once, on every rank from the same gathered values (the
allgather that agrees the topology-aware defaults carries them), and every rank
raises the same ConfigError naming each setting and each rank's value; settings
that are each rank's own are reported once, by rank 0, as a warning.
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Sequence

from hvdlite.config import OPTIONS, Agreement, Option
from hvdlite.config_values import parse_bucket_bytes, parse_bytes
from hvdlite.errors import ConfigError
from hvdlite.policy.defaults import RankSettings, describe_bytes

_log = logging.getLogger("hvdlite")


def check(everyone: Sequence[RankSettings], me: int) -> None:
    """Raise ConfigError (the same on every rank, since every rank decides from the same
    ``everyone``) where a setting that must agree differs; rank 0 warns once about the
    settings that may differ and do."""
    errors, notes = [], []
    for option in OPTIONS:
        values = [getattr(rank.config, option.field) for rank in everyone]
        if option.agreement is Agreement.SET and len({bool(v) for v in values}) > 1:
            errors.append(_differences(option, everyone, _set_or_unset))
        elif len(set(values)) > 1:
            line = _differences(option, everyone, functools.partial(_shown, option))
            if option.agreement is Agreement.SAME:
                errors.append(line)
            else:
                notes.append(line + (" (rank 0's is used)" if option.agreement is Agreement.SET
                                     else ""))
    if errors:
        raise ConfigError(
            f"rank {me}: hvdlite.init(): settings that must be the same on every rank differ "
            f"between ranks: {'; '.join(errors)}. They decide which collectives a rank runs and "
            "how (the buckets, the fusion, the negotiation, the backends, the report's "
            "gather at shutdown): ranks that differ would wait on collectives the others "
            "never start. The environment differs between the ranks: "
            "set each variable for every rank alike, or for none (docs/configuration.md, "
            "'Settings every rank must share')")
    if notes and me == 0:
        _log.warning("settings differ between ranks (each rank keeps its own; they do not "
                     "shape the collectives): %s", "; ".join(notes))


def _differences(option: Option, everyone: Sequence[RankSettings],
                 show: Callable[[Any], str]) -> str:
    """'HVDLITE_X: ranks 0, 2 <value> (<source>), rank 1 <value> (<source>)', the ranks
    grouped by what they hold."""
    groups: dict[tuple[str, str], list[int]] = {}
    for rank, settings in enumerate(everyone):
        value = getattr(settings.config, option.field)
        groups.setdefault((show(value), _source(option, settings)), []).append(rank)
    parts = [f"{'ranks' if len(ranks) > 1 else 'rank'} {_spans(ranks)} {shown} ({source})"
             for (shown, source), ranks in list(groups.items())[:_MOST_GROUPS]]
    if len(groups) > _MOST_GROUPS:
        parts.append(f"{len(groups) - _MOST_GROUPS} more values")
    return f"{option.env}: {', '.join(parts)}"


# Values listed per setting; a path that holds each rank's number has one per rank.
_MOST_GROUPS = 8


def _spans(ranks: list[int]) -> str:
    """'0, 2, 5-9': ascending ranks, runs of three or more as first-last."""
    spans: list[list[int]] = []
    for rank in ranks:
        if spans and rank == spans[-1][-1] + 1:
            spans[-1].append(rank)
        else:
            spans.append([rank])
    return ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 2 else ", ".join(map(str, run))
                     for run in spans)


def _source(option: Option, settings: RankSettings) -> str:
    if option.field in settings.sources:
        return settings.sources[option.field]
    return "chosen from the topology" if option.field in settings.chosen else "default"


def _set_or_unset(value: Any) -> str:
    return "set" if value else "unset"


def _shown(option: Option, value: Any) -> str:
    if option.parse is parse_bucket_bytes:
        return describe_bytes(value, "all")
    if option.parse is parse_bytes:
        return describe_bytes(value)
    return repr(value)
