"""Horovod's build and runtime queries answer in every binding, with hvdlite's true
values: MPI is built and enabled; Gloo, DDL, oneCCL and ROCm are not."""
from __future__ import annotations

import importlib

import pytest

import hvdlite as hvd

FALSE = ("gloo_built", "gloo_enabled", "ddl_built", "ccl_built", "rocm_built")
TRUE = ("mpi_built", "mpi_enabled")


@pytest.mark.parametrize("binding", ["hvdlite", "hvdlite.torch", "hvdlite.tensorflow",
                                     "hvdlite.keras"])
def test_each_binding_answers_horovods_queries(binding: str) -> None:
    if binding != "hvdlite":
        pytest.importorskip(binding.replace("hvdlite.", "").replace("keras", "tensorflow"),
                            reason="this venv has no such framework (make test's Open MPI one)")
    module = importlib.import_module(binding)
    for name in FALSE + TRUE + ("nccl_built", "cuda_built", "is_homogeneous",
                                "start_timeline", "stop_timeline"):
        assert name in module.__all__ and callable(getattr(module, name)), name
    assert [getattr(module, name)() for name in FALSE] == [False] * len(FALSE)
    assert [getattr(module, name)() for name in TRUE] == [True] * len(TRUE)
    assert module.is_homogeneous() == hvd.is_homogeneous()
