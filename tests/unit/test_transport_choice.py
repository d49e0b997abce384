"""Which transport init() opens, and what the build queries say on each: MPI unless
torchrun started the process (then torch.distributed over Gloo)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

import hvdlite as hvd
from hvdlite.api import runtime
from hvdlite.errors import UsageError
from hvdlite.transport import choice


def test_torchrun_gets_torchs_transport_and_anything_else_mpis(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert choice.world_module().__name__ == "hvdlite.transport.mpi_transport"
    assert choice.chosen({"SLURM_PROCID": "0"}).name == "mpi"
    pytest.importorskip("torch.distributed")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    assert choice.world_module().__name__ == "hvdlite.transport.torch_transport"


def test_a_missing_library_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    """The chosen transport's library is missing: a UsageError naming the way out; any
    other missing module is the error it is."""
    def missing(name: str) -> None:
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    monkeypatch.setattr(choice.importlib, "import_module",
                        lambda module: missing("torch" if "torch" in module else "mpi4py"))
    with pytest.raises(UsageError, match=r"pip install 'hvdlite\[mpich\]'.*torchrun"):
        choice.world_module({})
    with pytest.raises(UsageError, match="torch is not installed"):
        choice.world_module({"TORCHELASTIC_RUN_ID": "x"})
    monkeypatch.setattr(choice.importlib, "import_module", lambda module: missing("numpy"))
    with pytest.raises(ModuleNotFoundError):
        choice.world_module({})


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
