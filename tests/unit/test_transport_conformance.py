"""The transport conformance checks (tests/transport_conformance.py) on the in-process
transport at 1 to 4 ranks, and on broken transports, each of which the check named for
it must catch: a check that cannot fail would prove nothing about MPI either."""
from __future__ import annotations

import array
from typing import Any, Callable, Optional, Sequence

import numpy as np
import pytest

from hvdlite.reduce_op import ReduceOp
from hvdlite.transport.base import DATA_OPS
from tests import transport_conformance as conformance
from tests.unit.fake_transport import (FakeChannel, FakeRound, FakeTransportError,
                                       ThreadTransport, run_transports)

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("check", conformance.CHECKS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_the_in_process_transport_conforms(size: int, check: Callable[[Any], None]) -> None:
    run_transports(size, check)


def test_split_node_follows_the_hosts() -> None:
    """Two hosts, uneven: what topology.detect builds local and cross groups from."""
    def node_of(t: ThreadTransport) -> tuple[int, int]:
        node = t.split_node(key=t.rank)
        return node.rank, node.size
    hosts = ["a", "b", "a", "a", "b"]
    assert run_transports(5, node_of, hosts) == [(0, 3), (0, 2), (1, 3), (2, 3), (1, 2)]


def test_the_engines_topology_runs_on_the_in_process_transport() -> None:
    from hvdlite.transport.topology import detect
    topologies = run_transports(4, lambda t: detect(t, {}), ["a", "a", "b", "b"])
    assert [(x.local_rank, x.local_size, x.cross_rank, x.cross_size) for x in topologies] == [
        (0, 2, 0, 2), (1, 2, 0, 2), (0, 2, 1, 2), (1, 2, 1, 2)]


# -- broken transports: one defect each, and the check that must catch it ---------------------
class OrRound(ThreadTransport):
    """Negotiation by OR: a bit one rank lacks would look agreed."""

    def band_round(self, vector: array.array) -> FakeRound:
        class Or(FakeRound):
            def start(self) -> Any:
                def finish(parts: list[Any]) -> None:
                    words = [np.frombuffer(p, dtype=np.uint64) for p in parts]
                    np.frombuffer(vector, dtype=np.uint64)[:] = np.bitwise_or.reduce(words)
                return self._t._post(vector.tobytes(), finish)
        return Or(self, vector)


class ReversedGather(ThreadTransport):
    def gather_awaited(self, obj: Any, wait: Any) -> Optional[list[Any]]:
        gathered = super().gather_awaited(obj, wait)
        return gathered[::-1] if gathered is not None else None


class UnwaitedGather(ThreadTransport):
    """Blocks on its own instead of handing the wait to the engine (which would then
    never see a peer lost mid-round)."""

    def gather_awaited(self, obj: Any, wait: Any) -> Optional[list[Any]]:
        return super().gather_awaited(obj, lambda pending: [p.wait() for p in pending])

    def bcast_awaited(self, obj: Any, wait: Any) -> Any:
        return super().bcast_awaited(obj, lambda pending: [p.wait() for p in pending])


class SplitIgnoresKey(ThreadTransport):
    def split(self, color: Optional[int], key: int) -> Optional[ThreadTransport]:
        return self._split(color, 0)


class SharedObjects(ThreadTransport):
    """Hands every rank the same objects: one rank's change shows on the others."""

    def allgather(self, obj: Any) -> list[Any]:
        return self._exchange(obj)


class SilentVerdicts(ThreadTransport):
    def liveness_channel(self) -> FakeChannel:
        channel = super().liveness_channel()
        channel.tell = lambda ranks, text: None     # type: ignore[method-assign]
        return channel


class SumForEveryOp(ThreadTransport):
    def allreduce_array(self, buf: np.ndarray, op: ReduceOp) -> None:
        super().allreduce_array(buf, ReduceOp.SUM if op in DATA_OPS else op)


class BroadcastFromZero(ThreadTransport):
    def broadcast_array(self, buf: np.ndarray, root: int) -> None:
        super().broadcast_array(buf, 0)


class GatherInArrival(ThreadTransport):
    def allgather_array(self, send: np.ndarray, recv: np.ndarray,
                        counts: Sequence[int]) -> None:
        parts = self._exchange(send.copy())
        recv[...] = np.concatenate(parts[::-1])


class AlltoallKeepsOwnParts(ThreadTransport):
    """Sends every rank the parts meant for the sender itself: counts match only by luck."""
    def alltoall_array(self, send: np.ndarray, send_counts: Sequence[int],
                       recv: np.ndarray, recv_counts: Sequence[int]) -> None:
        bounds = np.cumsum([0] + list(send_counts))
        parts = self._exchange(send[bounds[self.rank]: bounds[self.rank + 1]].copy())
        flat = np.concatenate(parts)
        recv[...] = np.resize(flat, recv.shape) if flat.size else recv


class DupSharesTheContext(ThreadTransport):
    def dup(self) -> ThreadTransport:
        twin = ThreadTransport(self.hub, self.rank)
        twin._seq = self._seq
        return twin


# Each defect gives a wrong answer (AssertionError), except a shared context, whose
# parts of different collectives meet: that fails whichever way the mix-up goes.
MIXED_UP = (AssertionError, ValueError, FakeTransportError)
BROKEN = [(OrRound, conformance.check_band_round),
          (ReversedGather, conformance.check_awaited_gather_and_bcast),
          (UnwaitedGather, conformance.check_awaited_gather_and_bcast),
          (SplitIgnoresKey, conformance.check_split),
          (SharedObjects, conformance.check_small_objects),
          (SilentVerdicts, conformance.check_liveness_channel),
          (SumForEveryOp, conformance.check_allreduce_array),
          (BroadcastFromZero, conformance.check_broadcast_array),
          (GatherInArrival, conformance.check_allgather_array),
          (AlltoallKeepsOwnParts, conformance.check_alltoall_array),
          (DupSharesTheContext, conformance.check_dup_is_a_context_of_its_own)]


@pytest.mark.parametrize("broken,check", BROKEN, ids=[b.__name__ for b, _ in BROKEN])
def test_each_check_catches_a_transport_broken_its_way(
        broken: type, check: Callable[[Any], None], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(conformance, "DEADLINE_S", 0.5)     # a missing verdict: fail soon
    run_transports(3, check)                                 # the sound transport passes
    with pytest.raises(MIXED_UP if broken is DupSharesTheContext else AssertionError):
        run_transports(3, check, make=broken)
