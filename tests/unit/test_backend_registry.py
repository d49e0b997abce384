"""The backend registry (hvdlite.backends.registry) and the chains built from it, without
MPI: registration, taken and unknown names, which device types a backend is asked for,
and the order backends are asked in (registration, before=, HVDLITE_BACKENDS)."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from hvdlite.backends import register_backend, registry, unregister_backend
from hvdlite.config import Config, parse_backends
from hvdlite.engine.chain import BackendChain
from hvdlite.errors import ConfigError, UnknownBackendError, UsageError
from hvdlite.reduce_op import ReduceOp
from hvdlite.transport.base import TransportKind
from hvdlite.transport.mpi_transport import MpiTransport
from tests.unit.fake_comm import RecordingComm

pytestmark = pytest.mark.usefixtures("device_registry")    # each test's own registry

F32 = np.dtype(np.float32)


def _toy(name: str, up_to: int = 1 << 40) -> Any:
    """A host backend class named ``name`` that takes allreduces of fewer than
    ``up_to`` bytes and remembers the sets it serves."""
    class Toy:
        def __init__(self, config: Any) -> None:
            self.name, self.config, self.sets = name, config, {}

        def supports(self, kind: str, dtype: np.dtype, device: str, nbytes: int,
                     op: ReduceOp = ReduceOp.SUM) -> bool:
            return kind == "allreduce" and nbytes < up_to and op is not ReduceOp.ADASUM

        def open_set(self, set_id: int, transport: Any) -> None:
            self.sets[set_id] = transport

        def close_set(self, set_id: int) -> None:
            self.sets.pop(set_id)
    Toy.__name__ = name
    return Toy


def _chain(**settings: Any) -> BackendChain:
    return BackendChain(Config.load({}, **settings))


def _picked(chain: BackendChain, nbytes: int = 8, kind: str = "allreduce",
            device: str = "cpu", op: ReduceOp = ReduceOp.SUM) -> str:
    return chain.pick(kind, F32, device, nbytes, op).name


def test_a_registered_host_backend_is_asked_before_mpi_and_the_rest_fall_through() -> None:
    register_backend("toy", _toy("toy"))
    chain = _chain()
    assert [e.name for e in registry.entries()][:3] == ["toy", "transport", "adasum"]
    assert _picked(chain) == "toy" and _picked(chain, 1 << 30) == "toy"
    assert _picked(chain, kind="broadcast") == "mpi"             # what it lacks: MPI
    assert _picked(chain, op=ReduceOp.ADASUM) == "adasum"
    assert [b.name for b in chain.chain_for("cpu")] == ["toy", "adasum", "ring", "mpi"]


def test_registering_the_same_backend_again_changes_nothing_another_under_its_name_is_refused(
        ) -> None:
    toy = _toy("toy")
    register_backend("toy", toy)
    register_backend("toy", toy)
    assert registry.names().count("toy") == 1
    with pytest.raises(UsageError, match="'toy' is already registered"):
        register_backend("toy", _toy("toy"))
    with pytest.raises(UsageError, match="'toy' is already registered"):
        register_backend("toy", toy, "cuda")
    with pytest.raises(UsageError, match="'mpi' is already registered"):
        register_backend("mpi", toy)


@pytest.mark.parametrize("name,factory,devices,match", [
    ("Toy", _toy("x"), "cpu", "lowercase"), ("cpu:toy", _toy("x"), "cpu", "lowercase"),
    ("", _toy("x"), "cpu", "lowercase"), ("toy", "not callable", "cpu", "not callable"),
    ("toy", _toy("x"), "cuda:0", "not 'cuda:0'"), ("toy", _toy("x"), [], "device types")])
def test_unusable_registrations_are_refused(name: str, factory: Any, devices: Any,
                                            match: str) -> None:
    with pytest.raises(UsageError, match=match):
        register_backend(name, factory, devices)
    assert name not in registry.names()


def test_an_unknown_name_is_refused_naming_it_and_every_registered_one() -> None:
    register_backend("toy", _toy("toy"))
    with pytest.raises(UnknownBackendError) as info:
        _chain(backends="cpu:toy,cpu:tyo")
    assert info.value.name == "tyo" and "toy" in info.value.registered
    assert "mpi" in info.value.registered
    assert isinstance(info.value, ConfigError)
    message = str(info.value)
    assert "HVDLITE_BACKENDS names backend 'tyo', which is not registered" in message
    assert "adasum, mpi, nccl, ps, ring, staged, torch-nccl, toy, transport" in message
    with pytest.raises(UnknownBackendError, match="before= names backend 'rign'"):
        register_backend("other", _toy("other"), before="rign")
    assert "other" not in registry.names()


def test_a_device_its_backend_does_not_serve_is_refused() -> None:
    with pytest.raises(ConfigError, match="asks backend 'ring' for cuda, but it serves cpu"):
        _chain(backends="cuda:ring")
    _chain(backends="cuda:nccl,staged")   # the CUDA plugin's, declared before it loads


def test_a_backend_is_asked_only_for_the_device_types_it_serves() -> None:
    register_backend("cpu-only", _toy("cpu-only"))
    register_backend("fake-only", _toy("fake-only"), devices="fake")
    register_backend("anywhere", _toy("anywhere"), devices=None, before="adasum")
    chain = _chain()
    assert [b.name for b in chain.chain_for("cpu")][:3] == ["cpu-only", "anywhere", "adasum"]
    assert _picked(chain, device="fake:1") == "fake-only"
    assert _picked(chain, device="apu:0") == "anywhere"
    with pytest.raises(LookupError, match=r"the chain is \['anywhere'\]"):
        _picked(chain, kind="broadcast", device="apu:0")


def test_registration_order_before_and_the_setting_decide_who_is_asked_first() -> None:
    register_backend("first", _toy("first"))
    register_backend("second", _toy("second"))
    register_backend("small", _toy("small", up_to=1000), before="mpi")
    chain = _chain(allreduce="auto", ring_threshold=1000)
    assert [b.name for b in chain.chain_for("cpu")] == ["first", "second", "adasum", "ring",
                                                        "small", "mpi"]
    assert _picked(chain) == "first"
    chain.configure(Config.load({}, backends="cpu:second"))
    assert _picked(chain) == "second"
    chain.configure(Config.load({}, backends="small,cpu:mpi", allreduce="mpi"))
    assert [b.name for b in chain.chain_for("cpu")] == ["small", "mpi", "first", "second",
                                                        "adasum"]
    assert (_picked(chain, 999), _picked(chain, 1000)) == ("small", "mpi")


def test_the_setting_may_name_a_host_backend_allreduce_leaves_out() -> None:
    chain = _chain(allreduce="mpi", backends="cpu:ps")
    assert _picked(chain) == "ps" and _picked(chain, kind="allgather") == "mpi"


def test_a_backend_registered_later_joins_at_configure_serving_every_open_set() -> None:
    chain = _chain()
    chain.open_set(0, MpiTransport(RecordingComm(1)))
    chain.open_set(3, MpiTransport(RecordingComm(1)))
    register_backend("late", _toy("late"))
    assert _picked(chain) == "mpi"             # not before a point every rank passes
    chain.configure(chain._config)
    late = chain.backend("late")
    assert _picked(chain) == "late" and sorted(late.sets) == [0, 3]
    unregister_backend("late")
    chain.configure(chain._config)
    assert _picked(chain) == "mpi" and late.sets == {}      # closed when dropped
    with pytest.raises(UsageError, match="no registered backend 'mpi' to remove"):
        unregister_backend("mpi")


def test_a_device_plugin_fills_in_its_declared_backends() -> None:
    for nccl in (_toy("nccl"), _toy("nccl")):          # the plugin imported afresh: again
        register_backend("nccl", nccl, "cuda")
        entry = next(e for e in registry.entries() if e.name == "nccl")
        assert entry.factory is nccl and entry.builtin
    assert [e.name for e in registry.entries()].index("nccl") > \
        [e.name for e in registry.entries()].index("mpi")      # its place kept
    with pytest.raises(UsageError, match="'staged' is already registered"):
        register_backend("staged", _toy("staged"), "cpu")     # not for another device


def test_the_old_devices_route_registers_by_the_backends_name_for_every_device() -> None:
    from hvdlite.engine import devices
    toy = _toy("old-route")
    devices.register_backend(toy)
    devices.register_backend(toy)
    assert devices.backend_factories() == [toy]
    assert _picked(_chain()) == "old-route" and _picked(_chain(), device="apu:0") == "old-route"


@pytest.mark.parametrize("text,value", [("", ""), (" CPU:Toy , cuda:nccl,", "cpu:toy,cuda:nccl"),
                                        ("toy", "toy")])
def test_the_setting_is_normalized(text: str, value: str) -> None:
    assert parse_backends(text) == value


@pytest.mark.parametrize("text", ["cpu:", ":toy", "a:b:c"])
def test_the_setting_refuses_what_is_not_a_name_or_device_name(text: str) -> None:
    with pytest.raises(ConfigError, match="HVDLITE_BACKENDS"):
        Config.load({"HVDLITE_BACKENDS": text})


@pytest.mark.parametrize("nccl_version,cuda_chain,picked", [
    (21805, ["nccl", "torch-nccl", "staged"], "nccl"),
    (None, ["torch-nccl", "staged"], "staged")])
def test_the_cuda_plugin_fills_in_nccl_and_staged_where_they_were_declared(
        monkeypatch: pytest.MonkeyPatch, load: Any, nccl_version: Any,
        cuda_chain: list[str], picked: str) -> None:
    """hvdlite/backends/gpu.py over the CuPy stand-in, loaded at the first cuda request:
    its backends take their declared names (which HVDLITE_BACKENDS could name before);
    without NCCL, only staging serves. torch-nccl serves only sets on the torch
    transport (torchrun), so an MPI world never picks it."""
    from hvdlite.engine import devices
    gpu = load(nccl_version)
    monkeypatch.setitem(devices._PLUGINS, "cuda", "hvdlite.backends.gpu")
    chain = _chain(backends="cuda:nccl")
    assert chain.chain_for("cuda") == []                   # not loaded yet
    assert _picked(chain, device="cuda:0") == picked
    assert [b.name for b in chain.chain_for("cuda")] == cuda_chain
    assert next(e for e in registry.entries() if e.name == "staged").factory is \
        gpu.staged.StagedBackend
    chain.configure(Config.load({}, gpu_allreduce="mpi"))
    assert _picked(chain, device="cuda:0") == "staged"


def test_on_a_transport_world_the_transport_backend_alone_serves_host_data() -> None:
    """torchrun's world (a transport, not an MPI communicator): the registry's built-in
    "transport" backend is asked and the MPI-based ones step aside; on an MPI world,
    the other way round. A registered backend is asked first on either."""
    from tests.unit.fake_transport import run_transports
    register_backend("toy", _toy("toy", up_to=16))
    on_mpi = _chain()
    on_mpi.open_set(0, MpiTransport(RecordingComm(2)))
    assert [b.name for b in on_mpi.chain_for("cpu")] == ["toy", "adasum", "ring", "mpi"]
    on_gloo = _chain(backends="cpu:transport")     # HVDLITE_BACKENDS may name it
    run_transports(1, lambda t: on_gloo.open_set(0, t), kind=TransportKind.TORCH)
    assert [b.name for b in on_gloo.chain_for("cpu")] == ["transport", "toy"]
    assert _picked(on_gloo, 1 << 20) == _picked(on_gloo, 8) == "transport"
    assert _picked(on_gloo, kind="alltoall") == "transport"
