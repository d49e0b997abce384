"""The transport conformance checks (tests/transport_conformance.py) on MPI, the
engine's transport: each on a private duplicate of COMM_WORLD, so that none meets
hvdlite's own traffic. The same checks run on the in-process transport in
tests/unit/test_transport_conformance.py."""
from __future__ import annotations

import array
from typing import Any, Callable, Iterator

import pytest
from mpi4py import MPI

from hvdlite.transport.mpi_transport import MpiTransport
from tests import transport_conformance as conformance

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def world() -> Iterator[MpiTransport]:
    transport = MpiTransport(MPI.COMM_WORLD.Dup())
    yield transport
    transport.free()


@pytest.mark.parametrize("check", conformance.CHECKS, ids=lambda c: c.__name__)
def test_mpi_conforms(world: MpiTransport, check: Callable[[Any], None]) -> None:
    check(world)


class _OrRound:
    """A round by bitwise OR: a bit one rank lacks would look agreed."""

    def __init__(self, comm: MPI.Comm, vector: array.array) -> None:
        self._comm, self._vector = comm, vector

    def start(self) -> MPI.Request:
        return self._comm.Iallreduce(MPI.IN_PLACE, self._vector, op=MPI.BOR)

    def free(self) -> None:
        pass


class _OrTransport(MpiTransport):
    def band_round(self, vector: array.array) -> Any:
        return _OrRound(self.comm, vector)


def test_the_round_check_catches_an_or_round_on_mpi() -> None:
    """The check fails on every rank alike (each sees the same wrong vector), so no
    rank is left waiting in a later collective."""
    broken = _OrTransport(MPI.COMM_WORLD.Dup())
    try:
        if broken.size == 1:
            pytest.skip("at one rank OR and AND agree")
        with pytest.raises(AssertionError, match="round 0"):
            conformance.check_band_round(broken)
    finally:
        broken.free()
