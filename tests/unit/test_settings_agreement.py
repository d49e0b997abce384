"""What init() makes of every rank's settings (hvdlite.policy.settings_agreement.check),
decided from the gathered values alone, so every rank decides alike: a setting that
must match and differs is the same ConfigError on every rank, naming the variable, each
rank's value and where it came from; one that may differ is one warning, on rank 0. Every
knob of the table declares which kind it is."""
from __future__ import annotations

import logging

import pytest

from hvdlite.config import OPTIONS, Agreement, Config, knob, parse_bool, sources
from hvdlite.errors import ConfigError
from hvdlite.policy.defaults import RankSettings
from hvdlite.policy.settings_agreement import check


def ranks(*environments: dict[str, str]) -> list[RankSettings]:
    return [RankSettings(Config.load(env), sources(env)) for env in environments]


def test_every_setting_declares_what_ranks_must_share() -> None:
    assert all(isinstance(option.agreement, Agreement) for option in OPTIONS)
    kinds = {option.field: option.agreement for option in OPTIONS}
    for field in ("autotune", "bucket_bytes", "fusion_threshold", "cycle_time",
                  "direct_threshold", "allreduce", "backends", "cache_capacity"):
        assert kinds[field] is Agreement.SAME, field
    assert kinds["report"] is kinds["elastic_dir"] is Agreement.SET
    assert kinds["log_level"] is kinds["timeline"] is Agreement.OWN


def test_a_knob_without_a_kind_is_refused() -> None:
    with pytest.raises(TypeError):
        knob(False, parse_bool, "a doc")                   # type: ignore[call-arg]
    with pytest.raises(TypeError, match="Agreement"):
        knob(False, parse_bool, "same", "a doc")          # type: ignore[arg-type]


@pytest.mark.parametrize("me", [0, 1, 2])
def test_a_difference_that_must_not_be_is_the_same_error_on_every_rank(me: int) -> None:
    everyone = ranks({}, {"HOROVOD_FUSION_THRESHOLD": "1048576"}, {})
    with pytest.raises(ConfigError) as info:
        check(everyone, me)
    assert str(info.value).startswith(f"rank {me}: hvdlite.init(): settings that must be")
    assert ("HVDLITE_FUSION_THRESHOLD: ranks 0, 2 64 MiB (default), rank 1 1 MiB "
            "(HOROVOD_FUSION_THRESHOLD='1048576')") in str(info.value)


def test_ranks_are_grouped_by_value_in_spans_and_many_values_cut_short() -> None:
    everyone = ranks(*([{}] * 5), {"HVDLITE_CYCLE_TIME": "2"}, *([{}] * 3),
                     {"HVDLITE_CYCLE_TIME": "2"})
    with pytest.raises(ConfigError, match=r"HVDLITE_CYCLE_TIME: ranks 0-4, 6-8 1\.0 \(default\), "
                                          r"ranks 5, 9 2\.0 \(HVDLITE_CYCLE_TIME='2'\)\. "):
        check(everyone, 3)
    many = ranks(*({"HVDLITE_RING_CHUNK": f"{k}K"} for k in range(1, 12)))
    with pytest.raises(ConfigError, match=r"rank 7 8 KiB \(HVDLITE_RING_CHUNK='8K'\), 3 more "
                                          r"values\. "):
        check(many, 0)


def test_a_default_chosen_for_the_node_is_told_apart() -> None:
    chosen = RankSettings(Config().replace(bucket_bytes="all"), {}, frozenset({"bucket_bytes"}))
    with pytest.raises(ConfigError, match=r"rank 0 all \(chosen from the topology\), "
                                          r"rank 1 0 B \(HVDLITE_BUCKET_BYTES='0'\)"):
        check([chosen, *ranks({"HVDLITE_BUCKET_BYTES": "0"})], 1)


@pytest.fixture(autouse=True)
def hvdlite_log_reaches_caplog(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(logging.getLogger("hvdlite"), "propagate", True)


def test_set_on_some_ranks_only_is_an_error_and_different_paths_a_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ConfigError, match=r"HVDLITE_REPORT: rank 0 set \(HVDLITE_REPORT='/a'\), "
                                          r"rank 1 unset \(default\)"):
        check(ranks({"HVDLITE_REPORT": "/a"}, {}), 1)
    with caplog.at_level(logging.WARNING, logger="hvdlite"):
        check(ranks({"HVDLITE_REPORT": "/a"}, {"HVDLITE_REPORT": "/b"}), 0)
    assert [r.getMessage() for r in caplog.records] == [
        "settings differ between ranks (each rank keeps its own; they do not shape the "
        "collectives): HVDLITE_REPORT: rank 0 '/a' (HVDLITE_REPORT='/a'), rank 1 '/b' "
        "(HVDLITE_REPORT='/b') (rank 0's is used)"]


def test_own_settings_are_one_warning_on_rank_0_only(caplog: pytest.LogCaptureFixture) -> None:
    everyone = ranks({"HVDLITE_LOG_LEVEL": "info"}, {"HVDLITE_SPIN_TIME": "5"})
    with caplog.at_level(logging.WARNING, logger="hvdlite"):
        check(everyone, 1)
        assert caplog.records == []
        check(everyone, 0)
    assert len(caplog.records) == 1
    message = caplog.records[0].getMessage()
    assert "HVDLITE_LOG_LEVEL: rank 0 'info' (HVDLITE_LOG_LEVEL='info'), rank 1 'warning' " \
           "(default)" in message and "HVDLITE_SPIN_TIME: " in message, message


def test_the_same_settings_everywhere_say_nothing(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="hvdlite"):
        check(ranks({"HVDLITE_CYCLE_TIME": "2"}, {"HOROVOD_CYCLE_TIME": "2"}), 0)
    assert caplog.records == []
