"""A backend registered from outside the package (tests/mpi/toy_backend.py) serves host
allreduces, asked before MPI, with NumPy's values; and a backend name nobody registered
is refused by init() and reconfigure() on every rank, with the same message, and nothing
waits on another rank."""
from __future__ import annotations

import os
from typing import Iterator

import numpy as np
import pytest
from mpi4py import MPI

import hvdlite as hvd
from hvdlite.api import runtime
from hvdlite.api.control import reconfigure
from hvdlite.backends import register_backend, unregister_backend
from hvdlite.errors import UnknownBackendError
from tests.mpi.conftest import rank_data
from tests.mpi.toy_backend import ToyBackend

pytestmark = pytest.mark.timeout(60)


def _toy() -> ToyBackend:
    return runtime.engine().executor.chain.backend("toy")


@pytest.fixture
def toy() -> Iterator[None]:
    register_backend("toy", ToyBackend)      # every rank, then a point every rank passes
    reconfigure()
    try:
        yield
    finally:
        unregister_backend("toy")
        reconfigure(backends="")


def _sum_checked(name: str, op: object = hvd.Sum) -> None:
    rank, size = hvd.rank(), hvd.size()
    inputs = [rank_data(r, (3, 5), np.float32, salt=7) for r in range(size)]
    result = hvd.allreduce(inputs[rank], op=op, name=name)
    reference = {hvd.Sum: np.sum, hvd.Max: np.max}[op](np.stack(inputs), axis=0)
    np.testing.assert_array_equal(result, reference)


def test_a_registered_backend_serves_host_allreduces_before_mpi(toy: None) -> None:
    before = _toy().calls
    _sum_checked("registered.sum")
    _sum_checked("registered.max", hvd.Max)
    assert _toy().calls - before == 2
    assert [b.name for b in runtime.engine().executor.chain.chain_for("cpu")][0] == "toy"
    hvd.broadcast(np.ones(3), root_rank=0, name="registered.broadcast")   # not its: MPI's
    assert _toy().calls - before == 2


def test_the_setting_asks_a_registered_backend_first_by_name(toy: None) -> None:
    register_backend("first", ToyBackend)     # registered later: asked before toy
    reconfigure(backends="cpu:toy")
    try:
        _sum_checked("registered.named")
        assert _toy().calls == 1
        assert runtime.engine().executor.chain.backend("first").calls == 0
    finally:
        unregister_backend("first")


def _same_everywhere(message: str) -> None:
    messages = MPI.COMM_WORLD.allgather(message)
    assert len(set(messages)) == 1, messages


def test_reconfigure_to_an_unknown_backend_is_refused_on_every_rank() -> None:
    with pytest.raises(UnknownBackendError) as info:
        reconfigure(backends="cpu:toyy")
    assert info.value.name == "toyy" and "mpi" in info.value.registered
    _same_everywhere(str(info.value))
    assert runtime.config().backends == ""
    hvd.allreduce(np.ones(2), name="registered.after.reconfigure")     # still running


def test_init_with_an_unknown_backend_is_refused_on_every_rank() -> None:
    hvd.shutdown()
    os.environ["HVDLITE_BACKENDS"] = "cpu:nope"
    try:
        with pytest.raises(hvd.ConfigError) as info:
            hvd.init()
    finally:
        del os.environ["HVDLITE_BACKENDS"]
        refused = not hvd.is_initialized()
        hvd.init()
    assert refused and isinstance(info.value, UnknownBackendError)
    assert "HVDLITE_BACKENDS names backend 'nope', which is not registered" in str(info.value)
    _same_everywhere(str(info.value))
    total = hvd.allreduce(np.ones(2), op=hvd.Sum, name="registered.after.init")
    np.testing.assert_array_equal(total, np.full(2, float(hvd.size())))
