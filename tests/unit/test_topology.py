"""Rank layout without MPI: which source of node identity is trusted, the local and
cross ranks it gives on uneven nodes (threads over a communicator that answers
allgather, split and split_node as MPI's transport would), and the srun misuse check."""
from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable, Optional

import pytest

from hvdlite.errors import HvdliteError
from hvdlite.transport.mpi_transport import check_launch
from hvdlite.transport.topology import Topology, detect, slurm_view


class Group:
    """What the ranks of one communicator share: an allgather slot per rank."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.slots: list[Any] = [None] * size
        self.barrier = threading.Barrier(size)
        self.lock = threading.Lock()
        self.children: dict[tuple[int, Any], Group] = {}

    def child(self, call: int, color: Any, size: int) -> "Group":
        with self.lock:
            return self.children.setdefault((call, color), Group(size))


class SimComm:
    """One rank's view of a Group, as a transport; ``hosts[rank]`` is the host a rank
    runs on."""

    def __init__(self, group: Group, rank: int, hosts: list[str], freed: list) -> None:
        self.group, self.rank, self.hosts, self.freed = group, rank, hosts, freed
        self.size = group.size
        self.splits = 0

    def allgather(self, value: Any) -> list:
        self.group.slots[self.rank] = value
        self.group.barrier.wait()
        out = list(self.group.slots)
        self.group.barrier.wait()
        return out

    def split(self, color: Any, key: int) -> "SimComm":
        entries = self.allgather((color, key, self.rank, self.hosts[self.rank]))
        mine = sorted((k, r, h) for c, k, r, h in entries if c == color)
        self.splits += 1
        group = self.group.child(self.splits, color, len(mine))
        index = [r for _, r, _ in mine].index(self.rank)
        return SimComm(group, index, [h for _, _, h in mine], self.freed)

    def split_node(self, key: int) -> "SimComm":
        return self.split(self.hosts[self.rank], key)

    def free(self) -> None:
        self.freed.append(self)


def detect_all(hosts: list[str], environ: Callable[[int], dict[str, str]]) -> list[Topology]:
    """detect() on every rank of a world laid out on ``hosts``."""
    size = len(hosts)
    world = Group(size)
    results: list[Optional[Topology]] = [None] * size
    errors: list[BaseException] = []
    freed: list = []

    def run(rank: int) -> None:
        try:
            comm: Any = SimComm(world, rank, hosts, freed)
            results[rank] = detect(comm, environ(rank))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
            world.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert not errors, errors
    assert len(freed) == 2 * size                    # each rank frees its local and cross comms
    return results  # type: ignore[return-value]


def slurm(nodes: list[int], locals_: list[int]) -> Callable[[int], dict[str, str]]:
    return lambda rank: {"SLURM_PROCID": str(rank), "SLURM_NTASKS": str(len(nodes)),
                         "SLURM_NODEID": str(nodes[rank]), "SLURM_LOCALID": str(locals_[rank])}


def layout(topos: list[Topology]) -> list[tuple]:
    return [(t.rank, t.size, t.local_rank, t.local_size, t.cross_rank, t.cross_size,
             t.is_homogeneous, t.source) for t in topos]


@pytest.mark.timeout(60)
def test_slurm_nodes_on_one_host_are_told_apart_and_uneven_nodes_are_heterogeneous() -> None:
    # Six ranks on one host, which srun says are nodes 0 (3 ranks), 1 (2) and 2 (1).
    nodes, locals_ = [0, 0, 1, 0, 1, 2], [0, 1, 0, 2, 1, 0]
    assert layout(detect_all(["h"] * 6, slurm(nodes, locals_))) == [
        (0, 6, 0, 3, 0, 3, False, "slurm"), (1, 6, 1, 3, 0, 2, False, "slurm"),
        (2, 6, 0, 2, 1, 3, False, "slurm"), (3, 6, 2, 3, 0, 1, False, "slurm"),
        (4, 6, 1, 2, 1, 2, False, "slurm"), (5, 6, 0, 1, 2, 3, False, "slurm")]


@pytest.mark.timeout(60)
def test_even_slurm_nodes_are_homogeneous() -> None:
    nodes, locals_ = [1, 0, 1, 0], [0, 0, 1, 1]
    assert layout(detect_all(["h"] * 4, slurm(nodes, locals_))) == [
        (0, 4, 0, 2, 0, 2, True, "slurm"), (1, 4, 0, 2, 1, 2, True, "slurm"),
        (2, 4, 1, 2, 0, 2, True, "slurm"), (3, 4, 1, 2, 1, 2, True, "slurm")]


@pytest.mark.timeout(120)
def test_slurm_is_trusted_beyond_256_ranks() -> None:
    """Counts above 256 are not cached small ints: they must be compared by value."""
    size = 300
    topos = detect_all(["h"] * size, slurm([r % 3 for r in range(size)],
                                            [r // 3 for r in range(size)]))
    assert {t.source for t in topos} == {"slurm"}
    assert [(t.local_rank, t.local_size, t.cross_rank, t.cross_size) for t in topos[-2:]] == [
        (99, 100, 1, 3), (99, 100, 2, 3)]


def test_a_topology_is_an_immutable_value() -> None:
    topo = Topology(0, 2, 0, 2, 0, 1, True, "shared-memory")
    assert topo == Topology(0, 2, 0, 2, 0, 1, True, "shared-memory") and len({topo, topo}) == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        topo.rank = 1  # type: ignore[misc]


@pytest.mark.timeout(60)
def test_shared_memory_decides_when_slurm_does_not_describe_every_rank() -> None:
    hosts = ["a", "b", "a", "b", "a"]
    shared = [(0, 5, 0, 3, 0, 2, False, "shared-memory"),
              (1, 5, 0, 2, 1, 2, False, "shared-memory"),
              (2, 5, 1, 3, 0, 2, False, "shared-memory"),
              (3, 5, 1, 2, 1, 2, False, "shared-memory"),
              (4, 5, 2, 3, 0, 1, False, "shared-memory")]
    nodes, locals_ = [0, 1, 2, 3, 4], [0, 0, 0, 0, 0]
    # One rank without SLURM's variables.
    partial = slurm(nodes, locals_)
    assert layout(detect_all(hosts, lambda r: {} if r == 3 else partial(r))) == shared
    # Two ranks claiming the same node and local id: not a view srun gives.
    assert layout(detect_all(hosts, slurm([0, 1, 2, 3, 3], locals_))) == shared
    # No SLURM at all.
    assert layout(detect_all(hosts, lambda r: {})) == shared


def test_slurm_view_needs_this_rank_and_this_size() -> None:
    env = {"SLURM_PROCID": "3", "SLURM_NPROCS": "4", "SLURM_NODEID": "1", "SLURM_LOCALID": "2"}
    assert slurm_view(3, 4, env) == (1, 2)            # SLURM_NPROCS, the older name
    assert slurm_view(3, 4, dict(env, SLURM_NTASKS="4", SLURM_NPROCS="9")) == (1, 2)
    assert slurm_view(3, 4, dict(env, SLURM_NTASKS="5")) is None
    assert slurm_view(3, 4, dict(env, SLURM_PROCID="1")) is None   # another rank's view
    assert slurm_view(1, 4, env) is None
    many = dict(env, SLURM_PROCID="1000", SLURM_NPROCS="2000")     # beyond cached small ints
    assert slurm_view(1000, 2000, many) == (1, 2)
    no_size = {k: v for k, v in env.items() if k != "SLURM_NPROCS"}
    assert slurm_view(3, 4, no_size) is None
    alone = {"SLURM_PROCID": "0", "SLURM_NODEID": "0", "SLURM_LOCALID": "0"}
    assert slurm_view(0, 1, alone) is None            # no size: not trusted
    for key in ("SLURM_PROCID", "SLURM_NODEID", "SLURM_LOCALID"):
        assert slurm_view(3, 4, {k: v for k, v in env.items() if k != key}) is None
        assert slurm_view(3, 4, dict(env, **{key: "x"})) is None


@pytest.mark.parametrize("environ", [
    {"SLURM_PROCID": "1", "SLURM_NTASKS": "4"},
    {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "1"},
])
def test_srun_tasks_that_are_each_a_world_of_one_are_refused(environ: dict) -> None:
    with pytest.raises(HvdliteError, match=r"srun started \d tasks.*SLURM_PROCID=\d.*--mpi=pmi"):
        check_launch(1, environ)


@pytest.mark.parametrize("size,environ", [
    (4, {"SLURM_PROCID": "1", "SLURM_NTASKS": "4"}),      # srun's tasks are one world
    (1, {"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}),      # one task
    (1, {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1", "SLURM_NTASKS": "8"}),  # step of 1
    (1, {"SLURM_NTASKS": "4"}),                           # not started by srun
    (1, {"SLURM_PROCID": "0", "SLURM_NTASKS": "many"}),   # unreadable: not ours to judge
    (1, {"SLURM_PROCID": "0", "SLURM_NTASKS": "0"}),      # nonsense: not ours either
    (1, {"SLURM_PROCID": "0"}),
    (1, {}),
])
def test_other_launches_pass_the_check(size: int, environ: dict) -> None:
    check_launch(size, environ)


def test_the_check_reads_the_process_environment_by_default(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_PROCID", "2")
    monkeypatch.setenv("SLURM_NTASKS", "3")
    monkeypatch.delenv("SLURM_STEP_NUM_TASKS", raising=False)
    with pytest.raises(HvdliteError, match="srun started 3 tasks"):
        check_launch(1)

