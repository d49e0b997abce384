"""Horovod's variables (HOROVOD_TIMELINE, HOROVOD_FUSION_THRESHOLD, ...), read where
hvdlite's own are unset; hvdlite's win where both are set. The HOROVOD_* variables
without a meaning here are each warned about once. hvdlite's own old names for a
setting (HVDLITE_GPU_BUCKET_BYTES) are read too, with a warning."""
from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Iterator, Optional

import pytest

from hvdlite import horovod_env
from hvdlite.config import OPTIONS, Config
from hvdlite.errors import ConfigError

CONFIGURATION_PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


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


# Horovod's variables and the hvdlite knob each sets, in the order they are read.
ALIASES = {
    "HVDLITE_CYCLE_TIME": ("HOROVOD_CYCLE_TIME",),
    "HVDLITE_FUSION_THRESHOLD": ("HOROVOD_FUSION_THRESHOLD",),
    "HVDLITE_CACHE_CAPACITY": ("HOROVOD_CACHE_CAPACITY",),
    "HVDLITE_STALL_CHECK_TIME": ("HOROVOD_STALL_CHECK_DISABLE",
                                 "HOROVOD_STALL_CHECK_TIME_SECONDS"),
    "HVDLITE_STALL_SHUTDOWN_TIME": ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS",),
    "HVDLITE_TIMELINE": ("HOROVOD_TIMELINE",),
    "HVDLITE_TIMELINE_MARK_CYCLES": ("HOROVOD_TIMELINE_MARK_CYCLES",),
    "HVDLITE_LOG_LEVEL": ("HOROVOD_LOG_LEVEL",),
    "HVDLITE_AUTOTUNE": ("HOROVOD_AUTOTUNE",),
    "HVDLITE_AUTOTUNE_LOG": ("HOROVOD_AUTOTUNE_LOG",),
}

# Every variable Horovod 0.28 reads at run time (horovod/common/common.h, operations.cc,
# logging.cc, utils/env_parser.cc, gloo_context.cc, its runner), besides its build settings.
HOROVOD_RUNTIME = (
    "HOROVOD_ELASTIC", "HOROVOD_MPI_THREADS_DISABLE", "HOROVOD_TIMELINE",
    "HOROVOD_TIMELINE_MARK_CYCLES", "HOROVOD_AUTOTUNE", "HOROVOD_AUTOTUNE_LOG",
    "HOROVOD_AUTOTUNE_WARMUP_SAMPLES", "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE",
    "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE",
    "HOROVOD_FUSION_THRESHOLD", "HOROVOD_CYCLE_TIME", "HOROVOD_STALL_CHECK_DISABLE",
    "HOROVOD_STALL_CHECK_TIME_SECONDS", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS",
    "HOROVOD_HIERARCHICAL_ALLREDUCE", "HOROVOD_HIERARCHICAL_ALLGATHER",
    "HOROVOD_TORUS_ALLREDUCE", "HOROVOD_CACHE_CAPACITY", "HOROVOD_BATCH_D2D_MEMCOPIES",
    "HOROVOD_NUM_NCCL_STREAMS", "HOROVOD_CPU_OPERATIONS", "HOROVOD_CONTROLLER",
    "HOROVOD_CCL_CACHE", "HOROVOD_GLOO_IFACE", "HOROVOD_ADASUM_MPI_CHUNK_SIZE",
    "HOROVOD_THREAD_AFFINITY", "HOROVOD_DISABLE_GROUP_FUSION", "HOROVOD_DISABLE_NVTX_RANGES",
    "HOROVOD_ENABLE_ASYNC_COMPLETION", "HOROVOD_DYNAMIC_PROCESS_SETS",
    "HOROVOD_ENABLE_XLA_OPS", "HOROVOD_LOG_LEVEL", "HOROVOD_LOG_HIDE_TIME",
    "HOROVOD_GPU_OPERATIONS", "HOROVOD_GPU_ALLREDUCE", "HOROVOD_GPU_ALLGATHER",
    "HOROVOD_GPU_BROADCAST", "HOROVOD_GPU_ALLTOALL", "HOROVOD_GPU_REDUCESCATTER",
    "HOROVOD_GLOO_TIMEOUT_SECONDS", "HOROVOD_GLOO_RENDEZVOUS_ADDR",
    "HOROVOD_GLOO_RENDEZVOUS_PORT", "HOROVOD_ELASTIC_TIMEOUT", "HOROVOD_START_TIMEOUT",
    "HOROVOD_SECRET_KEY", "HOROVOD_HOSTNAME", "HOROVOD_RANK", "HOROVOD_SIZE",
    "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE", "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE",
)


def test_horovods_names_are_read_for_the_knobs_they_mean() -> None:
    aliases = {option.env: option.aliases for option in OPTIONS if option.aliases}
    assert aliases == ALIASES


def test_horovods_variables_set_hvdlites_knobs_in_hvdlites_units() -> None:
    config = Config.load({
        "HOROVOD_FUSION_THRESHOLD": "33554432", "HOROVOD_CYCLE_TIME": "2.5",
        "HOROVOD_CACHE_CAPACITY": "0", "HOROVOD_STALL_CHECK_TIME_SECONDS": "30",
        "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "120", "HOROVOD_LOG_LEVEL": "INFO"})
    # Horovod's cycle time is in milliseconds and its stall times in seconds, as hvdlite's.
    assert (config.fusion_threshold, config.cycle_time, config.cache_capacity,
            config.stall_check_time, config.stall_shutdown_time, config.log_level) == (
        32 << 20, 2.5, 0, 30.0, 120.0, "info")


def test_horovods_autotune_switch_reads_as_horovod_reads_it() -> None:
    """Horovod reads HOROVOD_AUTOTUNE with strtol: any integer above 0 is on; hvdlite's
    boolean words are read as they say."""
    on = {value: Config.load({"HOROVOD_AUTOTUNE": value}).autotune
          for value in ("1", "2", " +3 ", "0", "-1", "false", "TRUE", "off", "")}
    assert on == {"1": True, "2": True, " +3 ": True, "0": False, "-1": False,
                  "false": False, "TRUE": True, "off": False, "": False}
    # Horovod's samples are counted in engine cycles, hvdlite's in steps: not read.
    assert Config.load({"HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "7"}).autotune_steps_per_sample == 5


def test_horovods_log_levels() -> None:
    levels = {horovod: Config.load({"HOROVOD_LOG_LEVEL": horovod}).log_level
              for horovod in ("trace", "DEBUG", "Warning", "fatal")}
    assert levels == {"trace": "debug", "DEBUG": "debug", "Warning": "warning", "fatal": "error"}


@pytest.mark.parametrize("variable", ["HOROVOD_AUTOTUNE", "HOROVOD_TIMELINE_MARK_CYCLES",
                                      "HOROVOD_STALL_CHECK_DISABLE"])
@pytest.mark.parametrize("value", ["maybe", "1abc", "0x1", "1.5", "enabled"])
def test_a_horovod_switch_that_is_no_switch_is_an_error(variable: str, value: str) -> None:
    """Horovod's strtol reads "maybe" as off and "1abc" as on, without a word."""
    with pytest.raises(ConfigError, match=rf"^{variable}={value!r} is invalid: expected an "
                                          r"integer \(above 0 is on"):
        Config.load({variable: value})


@pytest.mark.parametrize("variable, value, shown", [
    ("HOROVOD_FUSION_THRESHOLD", "lots", "HOROVOD_FUSION_THRESHOLD='lots' is invalid"),
    ("HOROVOD_CYCLE_TIME", "5ms", "HOROVOD_CYCLE_TIME='5ms' is invalid"),
    ("HOROVOD_CACHE_CAPACITY", "1k", "HOROVOD_CACHE_CAPACITY='1k' is invalid"),
    ("HOROVOD_STALL_CHECK_TIME_SECONDS", "-1", "HOROVOD_STALL_CHECK_TIME_SECONDS='-1' is invalid"),
    ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "x", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS='x' is "),
    ("HOROVOD_LOG_LEVEL", "loud", "HOROVOD_LOG_LEVEL='loud' is invalid"),
])
def test_every_horovod_number_read_refuses_what_is_no_number(variable: str, value: str,
                                                            shown: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(shown)):
        Config.load({variable: value})


def test_an_ignored_switch_that_is_no_switch_is_warned_about() -> None:
    """Quiet only where the value reads as the state that asks for nothing."""
    assert horovod_env.why_ignored("HOROVOD_HIERARCHICAL_ALLREDUCE", "0") is None
    assert horovod_env.why_ignored("HOROVOD_HIERARCHICAL_ALLREDUCE", "false") is None
    assert horovod_env.why_ignored("HOROVOD_HIERARCHICAL_ALLREDUCE", "maybe") is not None
    assert horovod_env.why_ignored("HOROVOD_LOG_HIDE_TIME", "1") is None
    assert horovod_env.why_ignored("HOROVOD_LOG_HIDE_TIME", "1abc") is not None


def _stall_check_time(disable: Optional[str], seconds: Optional[str]) -> float:
    environ = {name: value for name, value in (("HOROVOD_STALL_CHECK_DISABLE", disable),
                                               ("HOROVOD_STALL_CHECK_TIME_SECONDS", seconds))
               if value is not None}
    return Config.load(environ).stall_check_time


def test_horovods_stall_check_switch() -> None:
    assert _stall_check_time("1", "30") == 0.0      # Horovod: the switch wins over the time
    assert _stall_check_time("true", None) == 0.0
    assert _stall_check_time("0", "30") == 30.0     # off sets nothing
    assert _stall_check_time("0", None) == 60.0
    assert _stall_check_time(None, "5") == 5.0


def test_hvdlites_variable_wins_over_any_of_horovods(warnings: pytest.LogCaptureFixture) -> None:
    config = Config.load({"HVDLITE_FUSION_THRESHOLD": "1M", "HOROVOD_FUSION_THRESHOLD": "0",
                          "HVDLITE_STALL_CHECK_TIME": "10", "HOROVOD_STALL_CHECK_DISABLE": "1",
                          "HVDLITE_CYCLE_TIME": "2", "HOROVOD_CYCLE_TIME": "2.0",
                          "HVDLITE_LOG_LEVEL": "error", "HOROVOD_LOG_LEVEL": "loud"})
    assert (config.fusion_threshold, config.stall_check_time, config.cycle_time,
            config.log_level) == (1 << 20, 10.0, 2.0, "error")
    text = warnings.text
    assert "HVDLITE_FUSION_THRESHOLD='1M' and HOROVOD_FUSION_THRESHOLD='0'" in text
    assert "HVDLITE_STALL_CHECK_TIME='10' and HOROVOD_STALL_CHECK_DISABLE='1'" in text
    assert "HVDLITE_LOG_LEVEL='error' and HOROVOD_LOG_LEVEL='loud'" in text   # unused, so no error
    assert "HOROVOD_CYCLE_TIME" not in text      # the same value, written differently


@pytest.mark.parametrize("variable, value", [
    ("HOROVOD_FUSION_THRESHOLD", "lots"), ("HOROVOD_CYCLE_TIME", "-1"),
    ("HOROVOD_CACHE_CAPACITY", "-3"), ("HOROVOD_STALL_CHECK_TIME_SECONDS", "nan"),
    ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "soon"), ("HOROVOD_LOG_LEVEL", "verbose"),
    ("HOROVOD_STALL_CHECK_DISABLE", "maybe")])
def test_a_bad_horovod_value_is_a_config_error_naming_it(variable: str, value: str) -> None:
    with pytest.raises(ConfigError, match=f"^{variable}='{value}' is invalid: .* It sets HVDLITE_"):
        Config.load({variable: value})


@pytest.fixture
def fresh_process(warnings: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """No HOROVOD_* variable reported yet, as in a new process."""
    before = set(horovod_env._WARNED)
    horovod_env._WARNED.clear()
    yield warnings
    horovod_env._WARNED.clear()
    horovod_env._WARNED.update(before)


def _named(records: list[logging.LogRecord], variable: str) -> int:
    return sum(f"ignoring {variable}=" in record.getMessage() for record in records)


def test_horovods_variables_without_a_meaning_here_are_warned_about_once(
        fresh_process: pytest.LogCaptureFixture) -> None:
    ignored = {"HOROVOD_GPU_OPERATIONS": "NCCL", "HOROVOD_HIERARCHICAL_ALLREDUCE": "1",
               "HOROVOD_CPU_OPERATIONS": "gloo", "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "5",
               "HOROVOD_WITH_PYTORCH": "1"}
    quiet = {"HOROVOD_HIERARCHICAL_ALLGATHER": "0", "HOROVOD_CONTROLLER": "MPI",
             "HOROVOD_DYNAMIC_PROCESS_SETS": "1", "HOROVOD_CYCLE_TIME": "5"}
    Config.load({**ignored, **quiet})
    Config.load({**ignored, **quiet})           # init() again: nothing new
    records = fresh_process.records
    assert {name: _named(records, name) for name in ignored} == dict.fromkeys(ignored, 1)
    assert not any(_named(records, name) for name in quiet), fresh_process.text
    assert "HOROVOD_GPU_OPERATIONS='NCCL': a setting of Horovod's build" in fresh_process.text


@pytest.mark.parametrize("rank_variable", ["PMI_RANK", "OMPI_COMM_WORLD_RANK", "RANK",
                                           "SLURM_PROCID"])
def test_only_the_launchers_rank_0_warns_about_horovods_variables(
        fresh_process: pytest.LogCaptureFixture, rank_variable: str) -> None:
    Config.load({"HOROVOD_TORUS_ALLREDUCE": "1", rank_variable: "1"})
    assert "HOROVOD_TORUS_ALLREDUCE" not in fresh_process.text
    Config.load({"HOROVOD_TORUS_ALLREDUCE": "1", rank_variable: "0"})
    assert _named(fresh_process.records, "HOROVOD_TORUS_ALLREDUCE") == 1


def test_every_variable_horovod_reads_is_read_or_ignored_and_documented() -> None:
    aliases = {name for names in ALIASES.values() for name in names}
    assert set(HOROVOD_RUNTIME) == aliases | set(horovod_env.IGNORED)
    documented = set(re.findall(r"`(HOROVOD_[A-Z0-9_]+)`", CONFIGURATION_PAGE.read_text()))
    assert set(HOROVOD_RUNTIME) <= documented, sorted(set(HOROVOD_RUNTIME) - documented)


def test_the_old_gpu_bucket_size_is_read_as_the_one_bucket_size_with_a_warning(
        warnings: pytest.LogCaptureFixture) -> None:
    """HVDLITE_GPU_BUCKET_BYTES, folded into HVDLITE_BUCKET_BYTES: still read (not an
    unknown variable), with a warning naming the variable to set instead."""
    config = Config.load({"HVDLITE_GPU_BUCKET_BYTES": "4MiB"})
    assert config.bucket_bytes == 4 << 20 and not hasattr(config, "gpu_bucket_bytes")
    assert "HVDLITE_GPU_BUCKET_BYTES is deprecated; set HVDLITE_BUCKET_BYTES instead" in (
        warnings.text)
    assert "unknown" not in warnings.text
    warnings.clear()
    both = Config.load({"HVDLITE_GPU_BUCKET_BYTES": "4MiB", "HVDLITE_BUCKET_BYTES": "2MiB"})
    assert both.bucket_bytes == 2 << 20 and "both are set" in warnings.text
    warnings.clear()
    assert Config.load({}).bucket_bytes == 25 << 20 and warnings.text == ""


def test_one_bucket_size_setting() -> None:
    sizes = [o.env for o in OPTIONS if "BUCKET" in o.env]
    assert sizes == ["HVDLITE_BUCKET_BYTES"]
    assert [o.deprecated for o in OPTIONS if o.deprecated] == [("HVDLITE_GPU_BUCKET_BYTES",)]
