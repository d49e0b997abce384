"""Topology-aware defaults: settings the user left unset, chosen from where the
ranks run instead of fixed numbers.

The fixed defaults were measured with one rank per core. When the ranks of a node
outnumber the CPUs the job may use (``hvdlite.policy.cpus``: the affinity mask and
a cgroup quota) and they compute on those CPUs, every CPU cycle hvdlite spends
is taken from some rank's forward and backward pass, and throughput follows the
total CPU per step, not the latency of one reduction. There the reduction that
costs the least CPU wins (BENCHMARKS.md, the np=4 analysis: 4 ranks on 2 cores,
the engine's CPU per step 1.76x the hand-fused loop's Allreduce; MPICH's own
Allreduce in the ring's place cut it by 12% at the same throughput).

Ranks that compute on GPUs are weighed differently: their CPU mostly waits for
the GPU, so an extra rank per core does not take compute from anyone, and the
ring's lower latency on large buffers is kept.

Every rank must use the same settings (a ring on one rank and MPI's Allreduce on
another never meet), so each rank reports what it sees and the decision is the
same function of everyone's reports: a collective at ``init()``.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Iterable, Mapping

from hvdlite.config_values import ONE_BUCKET, UNBOUNDED_BYTES
from hvdlite.policy import cpus

_log = logging.getLogger("hvdlite")

# HVDLITE_RING_THRESHOLD that no buffer reaches: under HVDLITE_ALLREDUCE=auto,
# MPI's Allreduce at every size.
NO_RING = UNBOUNDED_BYTES
# HVDLITE_SPIN_TIME (microseconds) where every rank computing on the CPU has one of its own.
UNCROWDED_SPIN_US = 5000.0


def describe_bytes(nbytes: int, unbounded: str = "never") -> str:
    """'2 MiB', '256 KiB', ``unbounded`` (UNBOUNDED_BYTES: as a ring threshold 'never',
    as a bucket cap 'all') for the logs and the report."""
    if nbytes >= UNBOUNDED_BYTES:
        return unbounded
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << (shift - 4)) == 0:
            value = nbytes / (1 << shift)
            return f"{value:g} {unit}"
    return f"{nbytes} B"


@dataclasses.dataclass(frozen=True)
class Node:
    """What the ranks of one node report: how many there are, how many of them
    compute on the CPU, and how many CPUs they may use between them."""
    ranks: int
    cpu_ranks: int
    cpus: float

    @property
    def cpu_bound_sharing(self) -> bool:
        """More ranks than CPUs, and at least one of them computes on the CPU."""
        return self.ranks > self.cpus and self.cpu_ranks > 0


@dataclasses.dataclass(frozen=True)
class Placement:
    nodes: tuple[Node, ...]

    @property
    def crowded(self) -> Node | None:
        """The node whose ranks share CPUs they compute on (the most ranks per CPU),
        or None when no node has any."""
        sharing = [n for n in self.nodes if n.cpu_bound_sharing]
        return max(sharing, key=lambda n: n.ranks / max(n.cpus, 1e-9)) if sharing else None


@dataclasses.dataclass(frozen=True)
class RankSettings:
    """One rank's settings as it will run with them, and where each came from."""
    config: Any
    sources: Mapping[str, str]       # field -> "VARIABLE='text'", for those the environment set
    chosen: frozenset[str] = frozenset()   # fields the topology-aware defaults changed
    reasons: tuple[str, ...] = ()          # and why (the report shows rank 0's)


def choose(placement: Placement, explicit: Iterable[str]) -> tuple[dict[str, Any], list[str]]:
    """The settings to change from their fixed defaults, and one sentence per change
    saying why. Pure: the same placement gives the same answer on every rank."""
    fixed = set(explicit)
    changes: dict[str, Any] = {}
    reasons: list[str] = []
    crowded = placement.crowded
    if crowded is not None and "ring_threshold" not in fixed:
        # The ring moves 2(P-1)/P of the buffer through hvdlite's own sends, receives
        # and NumPy sums on the engine thread; MPICH's Allreduce does the same work in
        # C with less CPU, which is what the ranks compete for here.
        changes["ring_threshold"] = NO_RING
        reasons.append(
            f"HVDLITE_RING_THRESHOLD=never (MPI's Allreduce at every size): {crowded.ranks} "
            f"ranks compute on {crowded.cpus:g} CPUs of one node, so the reduction that "
            "costs the least CPU wins")
    if crowded is not None and "bucket_bytes" not in fixed:
        # Overlapping a bucket's reduction with the rest of backward needs a free core,
        # and there is none; each bucket costs a negotiation round and a collective that
        # every rank's engine must be scheduled for, while the others compute (BENCHMARKS.md,
        # "one bucket where ranks share cores": the transformer 1.11x at np=4 on 2 cores).
        changes["bucket_bytes"] = ONE_BUCKET
        reasons.append(
            f"HVDLITE_BUCKET_BYTES=all (one gradient bucket, reduced once backward is "
            f"done): {crowded.ranks} ranks compute on {crowded.cpus:g} CPUs of one node, so "
            "no core is free to overlap reductions with backward, and every further bucket "
            "costs a round that all ranks must be scheduled for")
    if crowded is None and any(n.cpu_ranks for n in placement.nodes) and (
            "spin_time" not in fixed):
        # A thread blocked on a result leaves its CPU idle, so polling the reduction
        # there without pauses takes no rank's compute and ends the wait sooner
        # (BENCHMARKS.md, "a CPU of its own: the engine polls": MLP and transformer at
        # np=2 on 2 cores, 0.81x and 0.93x of the hand-fused loop at 100 us, 0.91x and
        # 0.97x at 5 ms).
        changes["spin_time"] = UNCROWDED_SPIN_US
        reasons.append(
            f"HVDLITE_SPIN_TIME={UNCROWDED_SPIN_US:g} (the engine busy-polls up to "
            f"{UNCROWDED_SPIN_US / 1000:g} ms while a thread waits on a result): every rank "
            "that computes on the CPU has one of its own, which a waiting thread leaves idle")
    return changes, reasons


def local_node(local_comm: Any) -> Node:
    """Collective over the ranks of one node: what they report together. The CPUs
    they may use are the union of their affinity masks, capped by the tightest
    cgroup quota among them."""
    mine = (cpus.affinity(), cpus.cgroup_quota(), not cpus.gpus_in_use())
    everyone = local_comm.allgather(mine)
    union = frozenset().union(*(mask for mask, _, _ in everyone))
    quotas = [quota for _, quota, _ in everyone if quota is not None]
    available = float(len(union)) if not quotas else min(float(len(union)), min(quotas))
    return Node(len(everyone), sum(1 for _, _, cpu in everyone if cpu), available)


def agree(transport: Any, config: Any, sources: Mapping[str, str]) -> list[Any]:
    """Collective over ``transport`` (at init, on the engine thread): every rank's settings
    (``config``, with ``sources`` naming the fields its environment set) with the
    topology-aware defaults applied where that rank set nothing, in rank order, as
    ``RankSettings``. One allgather carries both what the defaults
    are chosen from and the settings, so that init() can compare them
    (``settings_agreement.check``) without a round of its own. Rank 0 logs the reasons
    for its own changes at info."""
    local = transport.split_node(key=transport.rank)
    try:
        node = local_node(local)
        leader = local.rank == 0
    finally:
        local.free()
    gathered = transport.allgather((node if leader else None, config, dict(sources)))
    placement = Placement(tuple(n for n, _, _ in gathered if n is not None))
    everyone = []
    for rank, (_, settings, set_by) in enumerate(gathered):
        changes, reasons = choose(placement, set_by)
        if reasons and rank == 0 == transport.rank:
            for reason in reasons:
                _log.info("default %s", reason)
        everyone.append(RankSettings(settings.replace(**changes) if changes else settings,
                                     set_by, frozenset(changes), tuple(reasons)))
    return everyone
