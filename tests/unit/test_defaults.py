"""Topology-aware defaults: the CPUs a process may use (affinity, cgroup v1 and v2
quotas, read from made-up trees), whether a node's ranks share the CPUs they compute
on, and the settings that follows (only those the user left unset)."""
from __future__ import annotations

from pathlib import Path

import pytest

from hvdlite.config_values import ONE_BUCKET
from hvdlite.policy import cpus, defaults
from hvdlite.policy.defaults import NO_RING, Node, Placement

CROWDED = {"ring_threshold": NO_RING, "bucket_bytes": ONE_BUCKET}


def _tree(tmp_path: Path, proc: str, files: dict[str, str]) -> tuple[str, str]:
    root = tmp_path / "cgroup"
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    root.mkdir(exist_ok=True)
    proc_file = tmp_path / "proc_cgroup"
    proc_file.write_text(proc)
    return str(root), str(proc_file)


def test_cgroup_v2_quota_is_the_tightest_level(tmp_path: Path) -> None:
    root, proc = _tree(tmp_path, "0::/job/step\n", {
        "cpu.max": "max 100000\n", "job/cpu.max": "300000 100000\n",
        "job/step/cpu.max": "150000 100000\n"})
    assert cpus.cgroup_quota(root, proc) == 1.5


def test_cgroup_v2_without_a_limit(tmp_path: Path) -> None:
    root, proc = _tree(tmp_path, "0::/job\n", {"job/cpu.max": "max 100000\n"})
    assert cpus.cgroup_quota(root, proc) is None


def test_cgroup_v1_quota(tmp_path: Path) -> None:
    root, proc = _tree(tmp_path, "4:memory:/x\n2:cpu,cpuacct:/docker/abc\n", {
        "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "200000\n",
        "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n",
        "cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"})
    assert cpus.cgroup_quota(root, proc) == 2.0


def test_no_cgroup_files_no_quota(tmp_path: Path) -> None:
    root, proc = _tree(tmp_path, "garbage\n1:cpu:/\n", {})
    assert cpus.cgroup_quota(root, proc) is None
    assert cpus.cgroup_quota(root, str(tmp_path / "absent")) is None


def test_cpus_available_is_the_affinity_capped_by_the_quota(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpus, "affinity", lambda: frozenset({0, 1, 2, 3}))
    root, proc = _tree(tmp_path, "0::/\n", {"cpu.max": "250000 100000\n"})
    assert cpus.cpus_available(root, proc) == 2.5
    root, proc = _tree(tmp_path / "b", "0::/\n", {"cpu.max": "800000 100000\n"})
    assert cpus.cpus_available(root, proc) == 4.0


def test_ranks_sharing_the_cpus_they_compute_on_use_mpis_allreduce_and_one_bucket() -> None:
    placement = Placement((Node(ranks=4, cpu_ranks=4, cpus=2.0),))
    changes, reasons = defaults.choose(placement, explicit=())
    assert changes == CROWDED
    assert reasons == [
        "HVDLITE_RING_THRESHOLD=never (MPI's Allreduce at every size): 4 ranks compute on 2 "
        "CPUs of one node, so the reduction that costs the least CPU wins",
        "HVDLITE_BUCKET_BYTES=all (one gradient bucket, reduced once backward is done): 4 "
        "ranks compute on 2 CPUs of one node, so no core is free to overlap reductions with "
        "backward, and every further bucket costs a round that all ranks must be scheduled "
        "for"]


@pytest.mark.parametrize("node", [
    Node(ranks=2, cpu_ranks=2, cpus=2.0),      # one core each
    Node(ranks=2, cpu_ranks=2, cpus=2.5),
    Node(ranks=3, cpu_ranks=1, cpus=4.0),      # one on the CPU, two on GPUs
])
def test_a_core_per_cpu_rank_polls_while_a_thread_waits(node: Node) -> None:
    changes, reasons = defaults.choose(Placement((node,)), explicit=())
    assert changes == {"spin_time": defaults.UNCROWDED_SPIN_US}
    assert reasons == [
        "HVDLITE_SPIN_TIME=5000 (the engine busy-polls up to 5 ms while a thread waits on "
        "a result): every rank that computes on the CPU has one of its own, which a "
        "waiting thread leaves idle"]
    assert defaults.choose(Placement((node,)), explicit={"spin_time"}) == ({}, [])


def test_gpu_ranks_keep_the_fixed_defaults() -> None:
    """Four GPUs on two CPUs: their CPU mostly waits on the GPU; nothing measured here."""
    assert defaults.choose(Placement((Node(ranks=4, cpu_ranks=0, cpus=2.0),)), ()) == ({}, [])


def test_a_crowded_node_anywhere_keeps_the_short_spin() -> None:
    placement = Placement((Node(2, 2, 8.0), Node(4, 4, 2.0)))
    assert "spin_time" not in defaults.choose(placement, ())[0]


def test_one_crowded_node_decides_for_every_rank() -> None:
    """Every rank must reduce alike: a ring on one node and MPI's Allreduce on another
    never meet. The slowest node sets the pace, so its need wins."""
    placement = Placement((Node(2, 2, 8.0), Node(8, 8, 4.0), Node(3, 3, 2.0)))
    assert placement.crowded == Node(8, 8, 4.0)         # the most ranks per CPU
    assert defaults.choose(placement, ())[0] == CROWDED


@pytest.mark.parametrize("given", sorted(CROWDED))
def test_a_setting_the_user_gave_is_kept(given: str) -> None:
    placement = Placement((Node(4, 4, 2.0),))
    changes, reasons = defaults.choose(placement, explicit={given})
    assert given not in changes and len(changes) == len(reasons) == 1
    assert defaults.choose(placement, explicit=set(CROWDED)) == ({}, [])


def test_describe_bytes() -> None:
    assert defaults.describe_bytes(NO_RING) == "never"
    assert defaults.describe_bytes(ONE_BUCKET, unbounded="all") == "all"
    assert defaults.describe_bytes(2 << 20) == "2 MiB"
    assert defaults.describe_bytes(256 << 10) == "256 KiB"
    assert defaults.describe_bytes(25 << 20) == "25 MiB"
    assert defaults.describe_bytes(1000) == "1000 B"


class _LocalComm:
    def __init__(self, reports: list) -> None:
        self.reports = reports

    def allgather(self, mine: object) -> list:
        return self.reports


def test_a_node_reports_the_union_of_its_ranks_cpus_and_their_tightest_quota() -> None:
    reports = [(frozenset({0}), None, True), (frozenset({1}), 1.5, True),
               (frozenset({1}), None, False), (frozenset({0}), None, True)]
    assert defaults.local_node(_LocalComm(reports)) == Node(ranks=4, cpu_ranks=3, cpus=1.5)
    bound = [(frozenset({i}), None, True) for i in range(4)]    # one core each, bound
    assert defaults.local_node(_LocalComm(bound)) == Node(4, 4, 4.0)
