"""The public names of hvdlite and its bindings: written out, and Horovod's.

Two promises. Every public name is bound by name in its module's source (a def, a
class, an import or an assignment), so editors, type checkers and help() find it,
and the names cover the factory's whole op set (``make_ops``, OP_NAMES) and the
runtime (COMMON_NAMES) as the very objects the factory made: a new op cannot be
left out of a binding. And each binding's public names are Horovod 0.28.1's for
the same module, but for the differences listed below, each with its reason.

The Horovod lists are facts read from Horovod's source: the names each module binds
at its top level that do not start with an underscore, less other libraries'
modules and functions it imports (os, re, warnings, inspect, torch, tensorflow,
keras, packaging). ``import hvdlite`` has no Horovod counterpart (Horovod's root
holds only ``run``): it is checked against the factory's set only.
"""
from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import hvdlite
from hvdlite.api.binding import OP_NAMES

ROOT = Path(__file__).resolve().parents[2]

# The objects these modules take from the framework bindings' own functions
# modules, not from the runtime (as Horovod's torch and tensorflow do).
OWN_OBJECT_COLLECTIVES = ("broadcast_object", "allgather_object")


def _import(module: str) -> ModuleType:
    for framework in ("torch", "tensorflow", "keras"):
        if module.startswith(f"hvdlite.{framework}"):
            pytest.importorskip(framework)
    return importlib.import_module(module)


def _op_set(module: str) -> dict[str, Any]:
    """The op set the binding's factory call produced (with the binding's wrappers)."""
    if module == "hvdlite":
        return hvdlite._OPS
    if module.startswith("hvdlite.torch"):
        return importlib.import_module("hvdlite.torch.ops").OPS
    if module.startswith("hvdlite.tensorflow"):
        return importlib.import_module("hvdlite.tensorflow.ops").OPS
    return importlib.import_module("hvdlite.keras.collectives").OPS


def _bound_by_name(path: Path) -> set[str]:
    """The names a module's source binds at its top level, by name (also inside a
    top-level if or try), and those its module ``__getattr__`` serves by name."""
    names: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                names.add(node.name)
                if node.name == "__getattr__":
                    names.update(n.value for n in ast.walk(node) if isinstance(n, ast.Constant)
                                 and isinstance(n.value, str) and n.value.isidentifier())
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names.update(n.id for t in targets for n in ast.walk(t)
                             if isinstance(n, ast.Name))
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, (ast.If, ast.Try)):
                visit(node.body)
                visit(node.orelse)
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)
    visit(ast.parse(path.read_text()).body)
    return names


BINDINGS = ("hvdlite", "hvdlite.torch", "hvdlite.torch.mpi_ops", "hvdlite.tensorflow",
            "hvdlite.tensorflow.mpi_ops", "hvdlite.keras")


@pytest.mark.parametrize("module", BINDINGS)
def test_every_public_name_is_bound_by_name(module: str) -> None:
    binding = _import(module)
    path = Path(binding.__file__)
    tree = ast.parse(path.read_text())
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.Call)
                and isinstance(n.func, ast.Name) and n.func.id in ("globals", "vars")], (
        f"{path.relative_to(ROOT)} makes names through globals(): write each one out")
    unnamed = sorted(set(binding.__all__) - _bound_by_name(path))
    assert not unnamed, f"{path.relative_to(ROOT)} exports names its source never binds: {unnamed}"


@pytest.mark.parametrize("module", BINDINGS)
def test_each_binding_names_the_factorys_whole_op_set_and_the_runtime(module: str) -> None:
    binding = _import(module)
    ops = _op_set(module)
    assert set(OP_NAMES) <= set(ops)
    # hvdlite.keras has the same names on every Keras backend: the factory's set, without
    # a backend binding's own extras (torch's sparse_allreduce_async).
    named = set(OP_NAMES) if module == "hvdlite.keras" else set(ops)
    bound = _bound_by_name(Path(binding.__file__))
    assert not sorted(named - bound), f"{module} leaves ops unnamed: {sorted(named - bound)}"
    assert not [name for name in named if getattr(binding, name) is not ops[name]]
    runtime = [name for name in hvdlite.COMMON_NAMES
               if not (name in OWN_OBJECT_COLLECTIVES and module.startswith(
                   ("hvdlite.torch", "hvdlite.tensorflow")))]
    assert not sorted(set(runtime) - bound), f"{module}: {sorted(set(runtime) - bound)}"
    assert not [name for name in runtime if getattr(binding, name) is not getattr(hvdlite, name)]
    assert set(OP_NAMES) | set(runtime) <= set(binding.__all__)


def test_help_shows_each_generated_op_under_its_binding_with_a_docstring() -> None:
    signature = inspect.signature(hvdlite.allreduce)
    assert list(signature.parameters)[:3] == ["tensor", "average", "name"]
    for name in OP_NAMES:
        op = getattr(hvdlite, name)
        assert op.__doc__, f"help(hvdlite.{name}) shows no description"
        assert "<locals>" not in op.__qualname__, f"hvdlite.{name} is {op.__qualname__}"
    assert hvdlite.allreduce_async.__module__ == "hvdlite"
    assert hvdlite.synchronize.__module__ == "hvdlite.api.submission"   # the runtime's own


# -- Horovod's names ---------------------------------------------------------------------------
# Read from Horovod 0.28.1 (https://github.com/horovod/horovod, tag v0.28.1 and master).
HOROVOD = {
    "horovod/torch/__init__.py": (
        "Adasum", "add_process_set", "allgather", "allgather_async", "allgather_object",
        "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "alltoall",
        "alltoall_async", "Average", "barrier", "broadcast", "broadcast_",
        "broadcast_async", "broadcast_async_", "broadcast_object",
        "broadcast_optimizer_state", "broadcast_parameters", "ccl_built",
        "check_extension", "Compression", "cross_rank", "cross_size", "cuda_built",
        "ddl_built", "DistributedOptimizer", "elastic", "global_process_set", "gloo_built",
        "gloo_enabled", "grouped_allgather", "grouped_allgather_async",
        "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
        "grouped_allreduce_async_", "grouped_reducescatter", "grouped_reducescatter_async",
        "HorovodInternalError", "init", "is_initialized", "join", "local_rank",
        "local_size", "Max", "Min", "mpi_built", "mpi_enabled", "mpi_threads_supported",
        "nccl_built", "poll", "ProcessSet", "Product", "rank", "reducescatter",
        "reducescatter_async", "remove_process_set", "rocm_built", "shutdown", "size",
        "sparse_allreduce_async", "start_timeline", "stop_timeline", "Sum",
        "SyncBatchNorm", "synchronize"),
    "horovod/torch/mpi_ops.py": (
        "Adasum", "add_process_set", "allgather", "allgather_async", "allreduce",
        "allreduce_", "allreduce_async", "allreduce_async_", "alltoall", "alltoall_async",
        "Average", "barrier", "broadcast", "broadcast_", "broadcast_async",
        "broadcast_async_", "ccl_built", "check_installed_version", "Compression",
        "cross_rank", "cross_size", "cuda_built", "ddl_built",
        "get_average_backwards_compatibility_fun", "global_process_set", "gloo_built",
        "gloo_enabled", "gpu_available", "grouped_allgather", "grouped_allgather_async",
        "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
        "grouped_allreduce_async_", "grouped_reducescatter", "grouped_reducescatter_async",
        "handle_average_backwards_compatibility", "HorovodAllgather", "HorovodAllreduce",
        "HorovodAlltoall", "HorovodBroadcast", "HorovodGroupedAllgather",
        "HorovodGroupedAllreduce", "HorovodGroupedReducescatter", "HorovodInternalError",
        "HorovodReducescatter", "init", "is_homogeneous", "is_initialized", "join",
        "local_rank", "local_size", "Max", "Min", "mpi_built", "mpi_enabled", "mpi_lib",
        "mpi_threads_supported", "nccl_built", "num_rank_is_power_2", "poll", "ProcessSet",
        "Product", "rank", "reducescatter", "reducescatter_async", "remove_process_set",
        "rocm_built", "shutdown", "size", "sparse_allreduce_async", "start_timeline",
        "stop_timeline", "Sum", "synchronize"),
    "horovod/tensorflow/__init__.py": (
        "Adasum", "add_process_set", "allgather", "allgather_object", "allreduce",
        "alltoall", "Average", "broadcast", "broadcast_", "broadcast_global_variables",
        "broadcast_object", "broadcast_object_fn", "broadcast_variables",
        "BroadcastGlobalVariablesHook", "ccl_built", "check_extension",
        "check_num_rank_power_of_2", "Compression", "cross_rank", "cross_size",
        "cuda_built", "ddl_built", "device_compatibility_check", "DistributedGradientTape",
        "DistributedOptimizer", "elastic", "global_process_set", "gloo_built",
        "gloo_enabled", "gpu_available", "grouped_allgather", "grouped_allreduce",
        "grouped_reducescatter", "handle_average_backwards_compatibility", "init",
        "is_homogeneous", "is_initialized", "join", "local_rank", "local_rank_op",
        "local_size", "local_size_op", "LocalGradientAggregationHelper", "Max", "Min",
        "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built",
        "PartialDistributedGradientTape", "process_set_included_op", "ProcessSet",
        "Product", "rank", "rank_op", "reducescatter", "refs_to_vars",
        "remove_process_set", "rocm_built", "shutdown", "size", "size_op", "split_list",
        "start_timeline", "stop_timeline", "Sum", "SyncBatchNormalization", "vars_to_refs"),
    "horovod/tensorflow/mpi_ops.py": (
        "Adasum", "add_process_set", "allgather", "alltoall", "Average", "broadcast",
        "broadcast_", "ccl_built", "check_installed_version", "check_num_rank_power_of_2",
        "cross_rank", "cross_size", "cuda_built", "ddl_built",
        "get_average_backwards_compatibility_fun", "get_ext_suffix", "global_process_set",
        "gloo_built", "gloo_enabled", "gpu_available", "grouped_allgather",
        "handle_average_backwards_compatibility", "init", "is_homogeneous",
        "is_initialized", "join", "local_rank", "local_rank_op", "local_size",
        "local_size_op", "Max", "Min", "mpi_built", "mpi_enabled", "MPI_LIB",
        "mpi_threads_supported", "nccl_built", "num_rank_is_power_2",
        "process_set_included_op", "ProcessSet", "Product", "rank", "rank_op",
        "remove_process_set", "rocm_built", "shutdown", "size", "size_op",
        "start_timeline", "stop_timeline", "Sum"),
    "horovod/keras/__init__.py": (
        "Adasum", "allgather", "allreduce", "Average", "broadcast",
        "broadcast_global_variables", "callbacks", "ccl_built", "Compression",
        "cross_rank", "cross_size", "cuda_built", "ddl_built", "DistributedOptimizer",
        "elastic", "global_process_set", "gloo_built", "gloo_enabled", "init",
        "is_initialized", "load_model", "local_rank", "local_size", "mpi_built",
        "mpi_enabled", "mpi_threads_supported", "nccl_built",
        "PartialDistributedOptimizer", "rank", "reducescatter", "rocm_built", "shutdown",
        "size", "start_timeline", "stop_timeline", "Sum"),
    "horovod/tensorflow/keras/__init__.py": (
        "add_process_set", "allgather", "allreduce", "Average", "broadcast",
        "broadcast_global_variables", "callbacks", "ccl_built", "Compression",
        "cross_rank", "cross_size", "cuda_built", "ddl_built", "DistributedOptimizer",
        "elastic", "global_process_set", "gloo_built", "gloo_enabled", "init",
        "is_initialized", "is_version_greater_equal_than", "load_model", "local_rank",
        "local_size", "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built",
        "ProcessSet", "rank", "reducescatter", "remove_process_set", "rocm_built",
        "shutdown", "size", "start_timeline", "stop_timeline", "Sum"),
    "horovod/keras/callbacks.py": (
        "BestModelCheckpoint", "BroadcastGlobalVariablesCallback",
        "LearningRateScheduleCallback", "LearningRateWarmupCallback",
        "MetricAverageCallback"),
    "horovod/tensorflow/keras/callbacks.py": (
        "BestModelCheckpoint", "BroadcastGlobalVariablesCallback",
        "is_version_greater_equal_than", "LearningRateScheduleCallback",
        "LearningRateWarmupCallback", "MetricAverageCallback"),
}

# Which Horovod modules each hvdlite module stands for (hvdlite.keras serves both
# ``horovod.keras`` and ``horovod.tensorflow.keras``).
COUNTERPARTS = {
    "hvdlite.torch": ("horovod/torch/__init__.py",),
    "hvdlite.torch.mpi_ops": ("horovod/torch/mpi_ops.py",),
    "hvdlite.tensorflow": ("horovod/tensorflow/__init__.py",),
    "hvdlite.tensorflow.mpi_ops": ("horovod/tensorflow/mpi_ops.py",),
    "hvdlite.keras": ("horovod/keras/__init__.py", "horovod/tensorflow/keras/__init__.py"),
    "hvdlite.keras.callbacks": ("horovod/keras/callbacks.py",
                                "horovod/tensorflow/keras/callbacks.py"),
}


def _reasons(reason: str, *names: str) -> dict[str, str]:
    return dict.fromkeys(names, reason)


_HELPERS = _reasons(
    "Horovod's implementation helpers (loading its C++ library, version and argument "
    "checks), imported into its module, not API",
    "check_extension", "check_installed_version", "check_num_rank_power_of_2",
    "device_compatibility_check", "get_average_backwards_compatibility_fun",
    "get_ext_suffix", "gpu_available", "handle_average_backwards_compatibility",
    "is_version_greater_equal_than", "mpi_lib", "MPI_LIB", "num_rank_is_power_2",
    "refs_to_vars", "split_list", "vars_to_refs")

# Horovod's names an hvdlite module does not have.
MISSING: dict[str, dict[str, str]] = {
    "hvdlite.torch": _HELPERS,
    "hvdlite.torch.mpi_ops": {**_HELPERS, **_reasons(
        "the torch.autograd.Function classes behind Horovod's differentiable ops; "
        "hvdlite's are private to hvdlite.torch.ops",
        "HorovodAllgather", "HorovodAllreduce", "HorovodAlltoall", "HorovodBroadcast",
        "HorovodGroupedAllgather", "HorovodGroupedAllreduce", "HorovodGroupedReducescatter",
        "HorovodReducescatter")},
    "hvdlite.tensorflow": {**_HELPERS, **_reasons(
        "Horovod's gradient aggregation for TF1 optimizers; hvdlite's optimizers aggregate "
        "on their own", "LocalGradientAggregationHelper")},
    "hvdlite.tensorflow.mpi_ops": _HELPERS,
    "hvdlite.keras": _HELPERS,
    "hvdlite.keras.callbacks": _HELPERS,
}

_RUNTIME_ADDED = {
    **_reasons("hvdlite's typed errors, in every binding (docs/guide/troubleshooting.md)",
               "HvdliteError", "UsageError", "HvdliteTypeError", "NotInitializedError",
               "NotSupportedError", "DuplicateNameError", "ConfigError", "MismatchError",
               "DeadlockError", "JoinError", "StallError", "ShutdownError", "PeerLostError",
               "CollectiveFailedError", "HostsUpdatedError", "StateError", "OutputPathError"),
    **_reasons("Horovod's error classes (horovod.common.exceptions), in every binding",
               "HorovodInternalError", "HostsUpdatedInterrupt"),
    "ReduceOp": "the enum whose members Average, Sum... are",
    "GroupHandle": "what the grouped *_async ops return",
    "local_device": "the device this rank's tensors go to (hvdlite's runtime)",
    "step_done": "marks a training step for the report (hvdlite's runtime)",
    "traffic": "bytes each collective sent (hvdlite's runtime)",
    "is_homogeneous": "Horovod's runtime query (its basics and mpi_ops), in every binding",
}
_WHOLE_RUNTIME = _reasons("every binding has the whole runtime (COMMON_NAMES)",
                          *hvdlite.COMMON_NAMES)
_WHOLE_OP_SET = _reasons("every binding has the factory's whole op set (OP_NAMES)", *OP_NAMES)

# hvdlite's names the Horovod module does not have (a name Horovod has is ignored here).
ADDED: dict[str, dict[str, str]] = {
    "hvdlite.torch": {**_RUNTIME_ADDED,
                      "PeriodicModelAverager": "local SGD, as torch names it (beyond Horovod)",
                      "PostLocalSGDOptimizer": "local SGD, as torch names it (beyond Horovod)",
                      "ZeroRedundancyOptimizer": "optimizer state sharded across ranks, as "
                                                 "torch names it (beyond Horovod)"},
    "hvdlite.torch.mpi_ops": _RUNTIME_ADDED,
    "hvdlite.tensorflow": {**_WHOLE_OP_SET, **_RUNTIME_ADDED,
                           "XlaCompileError": "raised when a collective is traced into XLA"},
    "hvdlite.tensorflow.mpi_ops": {**_WHOLE_OP_SET, **_RUNTIME_ADDED,
                                   "Compression": "the runtime's, as in every binding"},
    "hvdlite.keras": {**_WHOLE_OP_SET, **_WHOLE_RUNTIME, **_RUNTIME_ADDED,
                      "broadcast_variables": "the TensorFlow binding's, on Keras variables"},
    "hvdlite.keras.callbacks": {
        "PeriodicModelAverageCallback": "local SGD in model.fit (beyond Horovod)"},
}


def _public(module: ModuleType) -> set[str]:
    """__all__, or (without one) the classes and functions the module defines."""
    if hasattr(module, "__all__"):
        return set(module.__all__)
    return {name for name, value in vars(module).items() if not name.startswith("_")
            and getattr(value, "__module__", None) == module.__name__}


@pytest.mark.parametrize("module", sorted(COUNTERPARTS))
def test_each_bindings_names_are_horovods_but_the_listed_differences(module: str) -> None:
    binding = _import(module)
    horovods = {name for source in COUNTERPARTS[module] for name in HOROVOD[source]}
    missing = {name: reason for name, reason in MISSING[module].items()
               if name in horovods or name not in _HELPERS}   # _HELPERS serves them all
    added = set(ADDED[module]) - horovods
    assert set(missing) <= horovods, sorted(set(missing) - horovods)
    # Horovod's submodules (elastic, callbacks) are attributes, whether or not in __all__.
    submodules = {name for name in horovods
                  if inspect.ismodule(getattr(binding, name, None))}
    public = _public(binding) | submodules
    expected = (horovods - set(missing)) | added
    absent, extra = sorted(expected - public), sorted(public - expected)
    assert not absent, (f"{module} lacks {absent}, which Horovod's module or ADDED names: add "
                        "them, or list Horovod's in MISSING with the reason")
    assert not extra, (f"{module} has {extra}, which are not Horovod's names: list them in "
                       "ADDED with the reason, or drop them from MISSING once they are added")
