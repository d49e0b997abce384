"""The seams new frameworks and devices build on: side-effect-free imports, one
generated op set per binding, the adapter contract, typed config and errors."""
from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest

import hvdlite as hvd
from hvdlite.api.adapter import NUMPY, adapter_for
from hvdlite.api.binding import OP_NAMES
from hvdlite.config import OPTIONS, Config
from hvdlite.errors import ErrorKind, HvdliteTypeError, UsageError, error_class

# Horovod's torch names that the README promises (besides the generated op set).
HOROVOD_TORCH_NAMES = (
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "is_homogeneous", "mpi_threads_supported", "mpi_built",
    "mpi_enabled", "nccl_built", "gloo_built", "ccl_built", "cuda_built", "ProcessSet",
    "global_process_set", "add_process_set", "remove_process_set", "broadcast_object",
    "allgather_object", "start_timeline", "stop_timeline", "Average", "Sum", "Min", "Max",
    "Product", "Compression", "DistributedOptimizer", "SyncBatchNorm", "broadcast_parameters",
    "broadcast_optimizer_state", "join", "barrier", "poll", "synchronize",
    "grouped_allgather", "grouped_allgather_async", "grouped_reducescatter",
    "grouped_reducescatter_async", "HvdliteError")


def test_importing_hvdlite_and_torch_starts_no_mpi() -> None:
    code = ("import sys, hvdlite, hvdlite.torch; "
            "print('mpi4py.MPI' in sys.modules, 'hvdlite.engine.engine' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["False", "False"], out


def test_torch_binding_exports_every_runtime_name_and_horovods() -> None:
    torch_binding = pytest.importorskip("hvdlite.torch")
    runtime_public = set(hvd.__all__) - {"COMMON_NAMES", "__version__"}
    exported = set(torch_binding.__all__)
    assert runtime_public <= exported, sorted(runtime_public - exported)
    assert set(HOROVOD_TORCH_NAMES) <= exported, sorted(set(HOROVOD_TORCH_NAMES) - exported)
    missing = [name for name in exported if not hasattr(torch_binding, name)]
    assert not missing
    assert not any(type(getattr(torch_binding, n)).__name__ == "module" for n in exported)


def test_every_binding_has_the_whole_generated_op_set() -> None:
    for name in OP_NAMES:
        assert callable(getattr(hvd, name)), name
    assert not any(type(getattr(hvd, n)).__name__ == "module" for n in hvd.__all__)


def test_adapter_contract_and_lookup() -> None:
    array = np.arange(6.0).reshape(2, 3).T
    assert adapter_for(array) is NUMPY and NUMPY.to_array(array) is array
    with pytest.raises(HvdliteTypeError, match=r"numpy.ndarray.*got float \(1.5\)"):
        NUMPY.require(1.5, "allreduce")
    assert issubclass(HvdliteTypeError, TypeError) and issubclass(HvdliteTypeError, hvd.HvdliteError)
    assert issubclass(UsageError, ValueError) and issubclass(UsageError, hvd.HvdliteError)
    assert error_class(ErrorKind.MISMATCH) is hvd.MismatchError


def test_compression_is_framework_neutral() -> None:
    wide = np.linspace(0, 1, 5)
    wire, context = hvd.Compression.fp16.compress(wide)
    assert wire.dtype == np.float16
    restored = hvd.Compression.fp16.decompress(wire, context)
    assert restored.dtype == np.float64 and np.allclose(restored, wide, atol=1e-3)
    integers = np.arange(3)
    assert hvd.Compression.bf16.compress(integers)[0] is integers


def test_config_is_frozen_and_each_field_carries_its_variable() -> None:
    config = Config.load({})
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.allreduce = "ring"  # type: ignore[misc]
    assert config.replace(allreduce="ring").allreduce == "ring" and config.allreduce == "auto"
    with pytest.raises(hvd.ConfigError, match="unknown"):
        config.replace(allredcue="ring")
    assert {o.env for o in OPTIONS} >= {"HVDLITE_DIRECT_THRESHOLD", "HVDLITE_RING_THRESHOLD"}
    assert all(o.doc and callable(o.parse) for o in OPTIONS)


def test_process_set_is_a_pure_value() -> None:
    first = hvd.ProcessSet([2, 0, 2])
    assert first.ranks == [0, 2] and first.process_set_id is None
    before = hash(first)
    first.process_set_id = 7
    assert hash(first) == before == hash(hvd.ProcessSet([0, 2]))
    assert hvd.global_process_set.process_set_id == 0
    with pytest.raises(UsageError):
        hvd.ProcessSet([])


def test_negotiation_compares_device_and_submitting_thread() -> None:
    from hvdlite.negotiation.coordinator import build_response, find_mismatch
    from hvdlite.negotiation.requests import Descriptor, Kind
    cpu = Descriptor("g", Kind.ALLREDUCE, "float32", (4,))
    message = find_mismatch({0: cpu, 1: cpu._replace(device="cuda:0")})
    assert "device" in message and "ranks [1]" in message
    message = find_mismatch({0: cpu._replace(thread="MainThread"), 1: cpu._replace(thread="T-1")})
    assert "submitting thread" in message and "name" in message
    marked = build_response({0: cpu, 1: cpu._replace(error="root_rank=9 is outside")}, [])
    assert marked.error_kind is ErrorKind.MISMATCH
    assert "ranks [1]" in marked.error and "root_rank=9" in marked.error
