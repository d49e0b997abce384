"""init() compares every rank's settings: one that shapes the collectives and is set
on some ranks only (HVDLITE_*, or the Horovod variable that sets it) fails init() on
every rank with a ConfigError naming the variable and each rank's value, before any
collective could wait on it; one that is each rank's own is one warning, from rank 0.
Every test sets the environment on some ranks only, then starts hvdlite again."""
from __future__ import annotations

import contextlib
import logging
import os
from typing import Iterator

import numpy as np
import pytest

import hvdlite as hvd
from hvdlite.api import runtime
from hvdlite.errors import ConfigError

pytestmark = pytest.mark.timeout(120)


@contextlib.contextmanager
def environment_on(ranks: list[int], **variables: str) -> Iterator[None]:
    """``variables`` set in this process's environment where its rank (asked before
    hvdlite stops) is in ``ranks``."""
    mine = hvd.rank() in ranks
    saved = {name: os.environ.get(name) for name in variables}
    if mine:
        os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def init_refused(ranks: list[int], **variables: str) -> str:
    """init() with ``variables`` on ``ranks`` only: the ConfigError's text on this rank.
    hvdlite runs again afterwards, on the environment every rank shares."""
    rank = hvd.rank()
    with environment_on(ranks, **variables):
        hvd.shutdown()
        with pytest.raises(ConfigError) as info:
            hvd.init()
    hvd.shutdown()      # where init() ran after all
    hvd.init()
    text = str(info.value)
    assert text.startswith(f"rank {rank}: hvdlite.init(): settings that must be the same"), text
    return text


def odd_ranks() -> list[int]:
    return list(range(1, hvd.size(), 2))


def test_fusion_threshold_on_odd_ranks_only_fails_init_on_every_rank() -> None:
    text = init_refused(odd_ranks(), HVDLITE_FUSION_THRESHOLD="1M")
    even = list(range(0, hvd.size(), 2))
    assert (f"HVDLITE_FUSION_THRESHOLD: {'ranks' if len(even) > 1 else 'rank'} "
            f"{', '.join(map(str, even))} 64 MiB (default), "
            f"{'ranks' if len(odd_ranks()) > 1 else 'rank'} {', '.join(map(str, odd_ranks()))} "
            "1 MiB (HVDLITE_FUSION_THRESHOLD='1M')") in text, text
    assert hvd.allreduce(np.ones(1), op=hvd.Sum, name="agreed.after").tolist() == [hvd.size()]


@pytest.mark.parametrize("variable,value,setting,shown", [
    ("HOROVOD_FUSION_THRESHOLD", "1048576", "HVDLITE_FUSION_THRESHOLD", "1 MiB"),
    ("HOROVOD_CYCLE_TIME", "5", "HVDLITE_CYCLE_TIME", "5.0"),
    ("HOROVOD_AUTOTUNE", "1", "HVDLITE_AUTOTUNE", "True"),
    ("HOROVOD_CACHE_CAPACITY", "0", "HVDLITE_CACHE_CAPACITY", "0"),
])
def test_horovods_variable_on_rank_0_only_fails_init(variable: str, value: str,
                                                     setting: str, shown: str) -> None:
    text = init_refused([0], **{variable: value})
    assert f"{setting}: rank 0 {shown} ({variable}='{value}'), " in text, text


@pytest.mark.parametrize("variable,value,shown", [
    ("HVDLITE_AUTOTUNE", "1", "True"),
    ("HVDLITE_BUCKET_BYTES", "0", "0 B"),
    ("HVDLITE_DIRECT_THRESHOLD", "4K", "4 KiB"),
    ("HVDLITE_ALLREDUCE", "ring", "'ring'"),
    ("HVDLITE_OUTPUT_CHECK", "warn", "'warn'"),
])
def test_a_shaping_setting_on_the_last_rank_only_fails_init(variable: str, value: str,
                                                            shown: str) -> None:
    last = hvd.size() - 1
    text = init_refused([last], **{variable: value})
    assert f"rank {last} {shown} ({variable}='{value}')" in text, text
    assert text.count(f"{variable}: ") == 1, text


def test_two_settings_differing_are_both_named() -> None:
    text = init_refused([0], HVDLITE_RING_CHUNK="64K", HVDLITE_CYCLE_TIME="3")
    assert "HVDLITE_CYCLE_TIME: rank 0 3.0 (HVDLITE_CYCLE_TIME='3')" in text, text
    assert "HVDLITE_RING_CHUNK: rank 0 64 KiB (HVDLITE_RING_CHUNK='64K')" in text, text


def test_a_report_on_rank_0_only_fails_init(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Every rank sends its record to rank 0 at shutdown when HVDLITE_REPORT is set."""
    directory = str(tmp_path_factory.mktemp("report"))
    text = init_refused([0], HVDLITE_REPORT=directory)
    assert "HVDLITE_REPORT: rank 0 set (HVDLITE_REPORT='" in text, text
    others = "rank 1" if hvd.size() == 2 else f"ranks 1-{hvd.size() - 1}"
    assert f"{others} unset (default)" in text, text
    assert os.listdir(directory) == []


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.mark.parametrize("variable,value", [("HVDLITE_SPIN_TIME", "7"),
                                            ("HVDLITE_PEER_TIMEOUT", "33")])
def test_a_rank_s_own_setting_is_one_warning_from_rank_0(variable: str, value: str) -> None:
    last = hvd.size() - 1
    seen = Lines()
    logger = logging.getLogger("hvdlite")
    with environment_on([last], **{variable: value}):
        hvd.shutdown()
        logger.addHandler(seen)
        try:
            hvd.init()
        finally:
            logger.removeHandler(seen)
    differ = [line for line in seen.lines if "settings differ between ranks" in line]
    if hvd.rank() == 0:
        assert len(differ) == 1, seen.lines
        assert f"{variable}: " in differ[0] and f"rank {last} " in differ[0], differ
        assert f"({variable}='{value}')" in differ[0], differ
    else:
        assert differ == [], seen.lines
    hvd.shutdown()
    hvd.init()          # the environment every rank shares again
    assert hvd.allreduce(np.ones(1), op=hvd.Sum, name="own.after").tolist() == [hvd.size()]


def test_the_same_settings_everywhere_start_without_a_word() -> None:
    seen = Lines()
    logger = logging.getLogger("hvdlite")
    with environment_on(list(range(hvd.size())), HVDLITE_FUSION_THRESHOLD="1M"):
        hvd.shutdown()
        logger.addHandler(seen)
        try:
            hvd.init()
            assert runtime.config().fusion_threshold == 1 << 20
        finally:
            logger.removeHandler(seen)
            hvd.shutdown()
    hvd.init()
    assert not [line for line in seen.lines if "differ between ranks" in line], seen.lines
