"""Which transport init() opens, and what the build queries say on each: MPI unless
torchrun started the process (then torch.distributed over Gloo)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

import hvdlite as hvd
from hvdlite.api import runtime


def test_torchrun_gets_torchs_transport_and_anything_else_mpis(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert runtime._world().__name__ == "hvdlite.transport.mpi_transport"
    pytest.importorskip("torch.distributed")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    assert runtime._world().__name__ == "hvdlite.transport.torch_transport"


@pytest.mark.parametrize("name,gloo,mpi", [("gloo", True, False), ("mpi", False, True)])
def test_the_build_queries_follow_the_running_transport(
        monkeypatch: pytest.MonkeyPatch, name: str, gloo: bool, mpi: bool) -> None:
    engine = SimpleNamespace(transport=SimpleNamespace(name=name), dead=None)
    monkeypatch.setattr(runtime.RUNTIME, "engine", engine)
    assert runtime.transport_name() == name
    assert (hvd.gloo_built(), hvd.gloo_enabled(), hvd.mpi_enabled()) == (gloo, gloo, mpi)


def test_before_init_gloo_is_off_and_mpi_is_what_is_installed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runtime.RUNTIME, "engine", None)
    assert runtime.transport_name() is None
    assert not hvd.gloo_built() and not hvd.gloo_enabled()
    assert hvd.mpi_enabled() == hvd.mpi_built()


@pytest.mark.parametrize("environ,prefix", [
    ({"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "2"},
     "/hvdlite/attempt_2"),                    # the agent's store outlives restarts
    ({"TORCHELASTIC_USE_AGENT_STORE": "True"}, "/hvdlite/attempt_0"),
    # the workers' own store, new at every start; the agents' counts may differ there
    ({"TORCHELASTIC_USE_AGENT_STORE": "False", "TORCHELASTIC_RESTART_COUNT": "1"}, "/hvdlite"),
    ({"TORCHELASTIC_USE_AGENT_STORE": "False", "TORCHELASTIC_RESTART_COUNT": "0"}, "/hvdlite"),
])
def test_workers_meet_under_the_attempts_keys_only_in_the_agents_store(
        environ: dict[str, str], prefix: str) -> None:
    torch_transport = pytest.importorskip("hvdlite.transport.torch_transport")
    assert torch_transport._store_prefix(environ) == prefix
