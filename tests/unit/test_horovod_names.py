"""Horovod names that work before init() or refuse clearly: help() of the optimizers
(whose process_set default prints the global set), and ProcessSet(comm) under torchrun."""
from __future__ import annotations

import subprocess
import sys
import types

import pytest

import hvdlite as hvd
from tests.mpirun import ROOT


def test_the_global_set_prints_before_init() -> None:
    assert not hvd.is_initialized()
    assert repr(hvd.global_process_set) == (
        "ProcessSet(process_set_id=0, ranks=every rank, once hvdlite.init() ran)")
    with pytest.raises(hvd.NotInitializedError):
        hvd.global_process_set.size()            # its ranks are still unknown


def test_help_of_every_distributed_optimizer_works_before_init() -> None:
    code = ("import pydoc\n"
            "import hvdlite.keras, hvdlite.tensorflow, hvdlite.torch\n"
            "for binding in (hvdlite.keras, hvdlite.tensorflow, hvdlite.torch):\n"
            "    for name in ('DistributedOptimizer', 'PartialDistributedOptimizer'):\n"
            "        if hasattr(binding, name):\n"
            "            text = pydoc.render_doc(getattr(binding, name))\n"
            "            assert 'process_set' in text, text\n"
            "print('rendered')\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={"PYTHONPATH": str(ROOT),
                                                       "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert proc.returncode == 0 and "rendered" in proc.stdout, proc.stdout + proc.stderr


class _Comm:
    """Stands in for mpi4py's communicator class."""


def test_a_communicator_under_torchrun_is_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", types.SimpleNamespace(Comm=_Comm))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    with pytest.raises(hvd.UsageError, match="started by torchrun and runs on the torch transport.*pass the list of ranks"):
        hvd.ProcessSet(_Comm())
    assert hvd.ProcessSet([2, 0]).ranks == [0, 2]


def test_neither_ranks_nor_a_communicator_is_a_usage_error() -> None:
    with pytest.raises(hvd.UsageError, match="a list of ranks or an mpi4py communicator"):
        hvd.ProcessSet(None)
