"""The backend chain, without MPI: which backend HVDLITE_ALLREDUCE and the op choose,
device plugins' backends joining the front of the chain for every open set, and the
byte totals over every backend."""
from __future__ import annotations

import dataclasses
from typing import Any, Iterator

import numpy as np
import pytest

from hvdlite.config import Config
from hvdlite.engine.chain import BackendChain
from hvdlite.reduce_op import ReduceOp
from hvdlite.transport.base import TransportKind
from hvdlite.transport.mpi_transport import MpiTransport
from tests.unit import fake_device_plugin as plugin
from tests.unit.fake_comm import RecordingComm

F32 = np.dtype(np.float32)


def _chain(**settings: Any) -> BackendChain:
    return BackendChain(Config.load({}, **settings))


def _picked(chain: BackendChain, nbytes: int, op: ReduceOp = ReduceOp.SUM,
            kind: str = "allreduce") -> str:
    return chain.pick(kind, F32, "cpu", nbytes, op).name


def test_auto_uses_mpi_below_the_ring_threshold_and_the_ring_from_it() -> None:
    # As from the environment: a string made at run time, not an interned literal.
    chain = BackendChain(Config.load({"HVDLITE_ALLREDUCE": "".join(["au", "to"]),
                                      "HVDLITE_RING_THRESHOLD": "1000"}))
    assert _picked(chain, 999) == "mpi" and _picked(chain, 1000) == "ring"
    assert _picked(chain, 1000, kind="reducescatter") == "ring"
    assert _picked(chain, 1 << 30, kind="allgather") == "mpi"


@pytest.mark.parametrize("setting,small,large", [("ring", "ring", "ring"),
                                                 ("mpi", "mpi", "mpi"), ("ps", "ps", "ps")])
def test_the_setting_picks_one_backend_for_every_size(setting: str, small: str, large: str) -> None:
    chain = _chain(allreduce=setting, ring_threshold=1000)
    assert (_picked(chain, 0), _picked(chain, 8), _picked(chain, 1 << 20)) == \
        (small, small, large)                             # empty tensors too
    assert _picked(chain, 8, kind="broadcast") == "mpi"     # what the others lack: MPI


def test_adasum_always_runs_on_its_own_backend() -> None:
    for setting in ("auto", "ring", "mpi", "ps"):
        assert _picked(_chain(allreduce=setting), 64, ReduceOp.ADASUM) == "adasum"


def test_a_remembered_pick_is_per_op() -> None:
    """Picks are remembered per call shape, op included: Sum and Adasum of the same
    tensor go to different backends whichever is asked first."""
    for first, second in ((ReduceOp.SUM, ReduceOp.ADASUM), (ReduceOp.ADASUM, ReduceOp.SUM)):
        chain = _chain(allreduce="mpi")
        picks = {op: _picked(chain, 64, op) for op in (first, second)}
        assert picks == {ReduceOp.SUM: "mpi", ReduceOp.ADASUM: "adasum"}
        assert _picked(chain, 64, first) == picks[first]     # asked again: the same


def test_reconfigure_rebuilds_the_chain() -> None:
    chain = _chain(allreduce="mpi", ring_threshold=1000)
    assert _picked(chain, 1 << 20) == "mpi"
    chain.configure(Config.load({}, allreduce="auto", ring_threshold=1000))
    assert _picked(chain, 1 << 20) == "ring" and _picked(chain, 8) == "mpi"


def test_reconfigure_changes_the_rings_chunk() -> None:
    """HVDLITE_RING_CHUNK was read when the ring was made and a reconfigure left it:
    autotune's ring_chunk trials all ran the first chunk."""
    chain = _chain(ring_chunk=256 << 10)
    chain.configure(Config.load({}, ring_chunk=1 << 20))
    ring = chain.pick("allreduce", F32, "cpu", 1 << 30)
    assert ring.name == "ring" and ring.chunk_bytes == 1 << 20


def test_nothing_supports_an_unknown_device() -> None:
    with pytest.raises(LookupError, match="no backend supports allreduce"):
        _chain().pick("allreduce", F32, "tpu:0", 8)


@pytest.fixture
def fake_device(monkeypatch: pytest.MonkeyPatch, device_registry: None) -> Iterator[list]:
    opened: list = []

    class Opening(plugin.FakeBackend):
        name = "fake-device"

        def supports(self, kind: str, dtype: np.dtype, device: str, nbytes: int,
                     op: ReduceOp = ReduceOp.SUM) -> bool:
            return device.startswith("fake")

        def reduction_dtype(self, dtype: np.dtype) -> np.dtype:
            return np.dtype(np.float64)

        def configure(self, config: Any) -> None:
            self.config = config

        def open_set(self, set_id: int, transport: Any) -> None:
            opened.append(set_id)

        def close_set(self, set_id: int) -> None:
            opened.remove(set_id)
    monkeypatch.setattr(plugin, "BACKENDS", [Opening])
    yield opened


def test_a_plugins_backend_joins_the_front_and_serves_every_open_set(fake_device: Any) -> None:
    chain = _chain()
    chain.open_set(0, MpiTransport(RecordingComm(1)))
    chain.open_set(5, MpiTransport(RecordingComm(1)))
    assert chain.pick("allreduce", F32, "fake:0", 8).name == "fake-device"
    assert fake_device == [0, 5]                     # it opened the sets already open
    assert chain.backends[0].name == "fake-device"
    assert chain.reduction_dtype(F32, "fake:0") == np.float64
    assert chain.reduction_dtype(F32, "cpu") == F32
    chain.close_set(5)
    assert fake_device == [0]
    settings = Config.load({}, gpu_allreduce="mpi")
    chain.configure(settings)
    assert chain.backends[0].config is settings          # plugin backends see changes
    assert _picked(chain, 8) == "mpi"                # the CPU still goes to the host


def test_traffic_totals_add_every_backend_and_count_estimates() -> None:
    chain = _chain()
    chain.backend("mpi").traffic.add("allreduce", 12, 20)    # MPI: an estimate
    chain.backend("ring").traffic.add("allreduce", 4, 6)     # the ring: exact
    assert chain.traffic_totals() == (16, 26, 32)
    assert chain.traffic()["ring"]["kinds"]["allreduce"] == {"calls": 1, "sent": 4,
                                                             "received": 6}


def test_on_another_transports_world_the_mpi_backends_are_never_made(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Made, they would import mpi4py's MPI, which starts an MPI in every torchrun
    worker; on an MPI world every host backend is made when the world set opens."""
    from hvdlite.backends import registry
    made: list[str] = []
    entries = []
    for entry in registry.entries():
        if entry.factory is not None:
            def factory(config: Any, _make: Any = entry.factory, _name: str = entry.name) -> Any:
                made.append(_name)
                return _make(config)
            entry = dataclasses.replace(entry, factory=factory)
        entries.append(entry)
    monkeypatch.setattr(registry, "entries", lambda: list(entries))

    class World:                    # a transport of another kind than MPI
        kind, rank, size = TransportKind.TORCH, 0, 2

        def allreduce_array(self, buf: np.ndarray, op: ReduceOp) -> None:
            buf *= self.size

    chain = _chain()
    chain.open_set(0, World())
    assert _picked(chain, 64) == "transport"
    chain.configure(Config.load({}, allreduce="ring"))
    assert _picked(chain, 1 << 20) == "transport"
    assert made == ["transport"]

    made.clear()
    mpi_chain = _chain()
    mpi_chain.open_set(0, MpiTransport(RecordingComm(2)))
    assert set(made) == {"transport", "adasum", "ps", "ring", "mpi"}
