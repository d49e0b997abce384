"""Horovod's variables for the timeline (HOROVOD_TIMELINE, HOROVOD_TIMELINE_MARK_CYCLES),
read where hvdlite's own are unset; hvdlite's win where both are set."""
from __future__ import annotations

import logging
from typing import Iterator

import pytest

from hvdlite.config import OPTIONS, Config
from hvdlite.errors import ConfigError


@pytest.fixture
def warnings(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    logger = logging.getLogger("hvdlite")
    propagate, logger.propagate = logger.propagate, True
    with caplog.at_level("WARNING", logger="hvdlite"):
        yield caplog
    logger.propagate = propagate


def test_horovods_variables_set_the_timeline_when_hvdlites_are_unset() -> None:
    config = Config.load({"HOROVOD_TIMELINE": "/x/t.json", "HOROVOD_TIMELINE_MARK_CYCLES": "1"})
    assert (config.timeline_path, config.timeline_mark_cycles) == ("/x/t.json", True)
    assert Config.load({}).timeline_path == "" and not Config.load({}).timeline_mark_cycles


def test_hvdlites_variable_wins_and_a_difference_is_reported(
        warnings: pytest.LogCaptureFixture) -> None:
    config = Config.load({"HVDLITE_TIMELINE": "/mine.json", "HOROVOD_TIMELINE": "/job.json",
                          "HVDLITE_TIMELINE_MARK_CYCLES": "0",
                          "HOROVOD_TIMELINE_MARK_CYCLES": "1"})
    assert (config.timeline_path, config.timeline_mark_cycles) == ("/mine.json", False)
    text = warnings.text
    assert "HVDLITE_TIMELINE='/mine.json' and HOROVOD_TIMELINE='/job.json'" in text
    assert "uses HVDLITE_TIMELINE_MARK_CYCLES" in text
    warnings.clear()
    same = Config.load({"HVDLITE_TIMELINE": "/t.json", "HOROVOD_TIMELINE": "/t.json"})
    assert same.timeline_path == "/t.json" and "HOROVOD_TIMELINE" not in warnings.text


def test_a_bad_value_names_the_variable_it_came_from() -> None:
    with pytest.raises(ConfigError, match="HOROVOD_TIMELINE_MARK_CYCLES='maybe' is invalid"):
        Config.load({"HOROVOD_TIMELINE_MARK_CYCLES": "maybe"})


@pytest.mark.parametrize("variable", ["HVDLITE_TIMELINE", "HOROVOD_TIMELINE"])
def test_dynamic_means_no_file_until_start_timeline(variable: str) -> None:
    """Horovod's HOROVOD_TIMELINE=DYNAMIC: a file named DYNAMIC is never written."""
    assert Config.load({variable: "DYNAMIC"}).timeline_path == ""


def test_only_the_timelines_and_autotune_take_horovods_names() -> None:
    aliases = {option.env: option.aliases for option in OPTIONS if option.aliases}
    assert aliases == {"HVDLITE_TIMELINE": ("HOROVOD_TIMELINE",),
                       "HVDLITE_TIMELINE_MARK_CYCLES": ("HOROVOD_TIMELINE_MARK_CYCLES",),
                       "HVDLITE_AUTOTUNE": ("HOROVOD_AUTOTUNE",),
                       "HVDLITE_AUTOTUNE_LOG": ("HOROVOD_AUTOTUNE_LOG",)}
