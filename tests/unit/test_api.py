"""Single-process checks: configuration, errors, calls before init, the timeline file."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import hvdlite as hvd
from hvdlite.config import OPTIONS, Config
from hvdlite.errors import ConfigError, HvdliteError, NotInitializedError
from hvdlite.negotiation.requests import Descriptor, Kind, Request
from hvdlite.recording.timeline import Timeline

ROOT = Path(__file__).resolve().parents[2]
CONFIGURATION_PAGE = ROOT / "docs" / "configuration.md"


def _docs_hooks():  # type: ignore[no-untyped-def]
    """docs/hooks.py, the MkDocs hook that generates the configuration page."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("call", [hvd.rank, hvd.size, hvd.local_rank, hvd.local_size,
                                  hvd.cross_rank, hvd.cross_size, hvd.is_homogeneous,
                                  hvd.mpi_threads_supported, hvd.barrier, hvd.join,
                                  lambda: hvd.allreduce(np.ones(2)),
                                  lambda: hvd.broadcast(np.ones(2), 0),
                                  lambda: hvd.start_timeline("/tmp/x.json")])
def test_calls_before_init_raise_not_initialized(call) -> None:  # type: ignore[no-untyped-def]
    assert not hvd.is_initialized()
    with pytest.raises(NotInitializedError, match=r"hvdlite.init\(\)"):
        call()


def test_tensorflow_collective_before_init_raises_not_initialized() -> None:
    """In a process of its own: hvdlite.tensorflow imported, hvd.init() never called
    (one process, no launcher: a single-process test, not a multi-rank one)."""
    pytest.importorskip("tensorflow")
    code = ("import tensorflow as tf, hvdlite.tensorflow as hvd\n"
            "try:\n    hvd.allreduce(tf.constant([1.0]))\n"
            "except hvd.NotInitializedError as e:\n    print('ok', e)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI", "MPI", "HYDRA"))}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(env, TF_CPP_MIN_LOG_LEVEL="3"), timeout=120)
    assert out.stdout.startswith("ok") and "hvdlite.init()" in out.stdout, out.stderr[-2000:]


def test_error_types_match_what_horovod_scripts_catch() -> None:
    assert issubclass(HvdliteError, RuntimeError)
    assert issubclass(NotInitializedError, ValueError) and issubclass(NotInitializedError, HvdliteError)
    assert issubclass(hvd.DuplicateNameError, ValueError)
    for error in (hvd.MismatchError, hvd.StallError, hvd.ShutdownError, hvd.JoinError,
                  hvd.PeerLostError):
        assert issubclass(error, HvdliteError)


def test_config_precedence_and_parsing() -> None:
    config = Config.load({"HVDLITE_FUSION_THRESHOLD": "2MiB", "HVDLITE_CYCLE_TIME": "0.5"},
                         cycle_time=2.0)
    assert config.fusion_threshold == 2 << 20
    assert config.cycle_time == 2.0                       # argument beats environment
    assert Config.load({}).allreduce == "auto"            # default
    with pytest.raises(ConfigError, match="HVDLITE_ALLREDUCE"):
        Config.load({"HVDLITE_ALLREDUCE": "nccl"})
    with pytest.raises(ConfigError, match="HVDLITE_ABORT_ON_ERROR"):
        Config.load({"HVDLITE_ABORT_ON_ERROR": "maybe"})
    with pytest.raises(ConfigError, match="unknown hvdlite option"):
        Config.load({}, not_an_option=1)


@pytest.mark.parametrize("field, value, message", [
    ("allreduce", "rign", "expected one of auto, mpi, ring, ps"),
    ("gpu_allreduce", "xla", "expected one of nccl, mpi"),
    ("fusion_threshold", -1, "a size cannot be negative"),
    ("cycle_time", -0.5, "must be a finite number >= 0"),
    ("stall_check_time", "nan", "must be a finite number >= 0"),
    ("peer_timeout", "inf", "must be a finite number >= 0"),
    ("elastic_persist_every", 0, "must be >= 1"),
    ("abort_on_error", "maybe", "expected 1/0"),
])
def test_values_given_in_code_are_checked_like_their_variables(field: str, value: object,
                                                               message: str) -> None:
    # init()'s keywords go through load(), reconfigure()'s through replace(): both refuse
    # what HVDLITE_<FIELD> would, naming the setting, before anything is negotiated.
    with pytest.raises(ConfigError, match=f"{field}={value!r} is invalid: {message}"):
        Config.load({}, **{field: value})
    with pytest.raises(ConfigError, match=f"{field}={value!r} is invalid: {message}"):
        Config.load({}).replace(**{field: value})


def test_values_given_in_code_keep_their_parsed_form() -> None:
    config = Config.load({}, allreduce="Ring", fusion_threshold="2MiB", abort_on_error=False)
    assert (config.allreduce, config.fusion_threshold, config.abort_on_error) == (
        "ring", 2 << 20, False)
    changed = config.replace(cycle_time=3, gpu_allreduce="mpi", timeline="/tmp/t.json")
    assert (changed.cycle_time, changed.gpu_allreduce, changed.timeline) == (
        3.0, "mpi", "/tmp/t.json")


def test_unknown_variable_is_reported(caplog: pytest.LogCaptureFixture) -> None:
    logger = __import__("logging").getLogger("hvdlite")
    logger.propagate = True
    with caplog.at_level("WARNING", logger="hvdlite"):
        Config.load({"HVDLITE_FUSION_TRESHOLD": "1"})
    assert "HVDLITE_FUSION_TRESHOLD" in caplog.text


def test_configuration_page_documents_every_variable() -> None:
    """The docs' configuration page is generated from OPTIONS as the site builds
    (docs/hooks.py): every variable and every Horovod alias, with its default."""
    hooks = _docs_hooks()
    page = hooks.expand(CONFIGURATION_PAGE.read_text())
    documented = set(re.findall(r"`((?:HVDLITE|HOROVOD)_[A-Z_]+)`", page))
    assert {option.env for option in OPTIONS} <= documented
    assert {alias for option in OPTIONS for alias in option.aliases} <= documented
    for option in OPTIONS:
        row = next(line for line in page.splitlines() if f"`{option.env}`" in line
                   and line.startswith("|"))
        assert hooks.describe_default(option.default, option.parse) in row, row
        assert " ".join(option.doc.split()).replace("|", "\\|") in row, row


def test_timeline_is_valid_json_after_every_event(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    timeline = Timeline(str(path))
    assert json.loads(path.read_text())[0]["ph"] == "M"
    timeline.span(Request(Descriptor("grad", Kind.ALLREDUCE), 0), "MPI_ALLREDUCE", 1.0, 1.5)
    timeline.close()
    events = json.loads(path.read_text())
    spans = [e for e in events if e["ph"] == "X"]
    rows = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert spans[0]["name"] == "MPI_ALLREDUCE" and rows[spans[0]["pid"]] == "allreduce.grad"
