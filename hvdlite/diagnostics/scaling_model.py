"""The scaling forecast's model: how long one data-parallel step takes on P ranks.
Pure functions on numbers (no MPI), shared by ``python -m hvdlite.forecast``,
the report's forecast line and the traffic benchmark's alpha-beta table.

One step on P ranks (the README's "Will it scale?" writes it out):

    step(P)  = compute + exposed(P) + sync(P)
    comm(P)  = k(P) (a_alg(P) + 2 ceil(log2 P) alpha) + b_alg(P) N
    exposed  = comm(P)                                      communication after backward
             = max(comm(P) - overlap x backward, comm(P) / k(P))   ... or overlapping it
    sync(P)  = sigma z(P)       the slowest of P ranks: z(P) = Phi^-1((P - 0.375) / (P + 0.25))

An allreduce of n bytes costs a_alg + b_alg n (latency per bucket, seconds per byte):

    ring          2(P-1) alpha              2(P-1) / (P B)      every rank moves 2N(P-1)/P
    ps            2(P-1) alpha              2(P-1) / B          the server moves N(P-1) each way
    hierarchical  2(L-1) alpha_i + 2(M-1) alpha    2(L-1)/(L B_i) + 2(M-1)/(M B)
                  (L ranks per node on the intra-node link, M = ceil(P/L) nodes)

k(P), the buckets per step: without overlap every gradient is ready at once and fused
into ceil(N / fusion) buckets; overlapping backward, buckets go as gradients become
ready, at most one per bucket latency (plus a fusion cycle, if any), so k(P) =
max(ceil(N / fusion), min(k_measured, ceil(overlap x backward / (latency per bucket + cycle)))).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any, Callable, Optional

from hvdlite.errors import ConfigError

ALGORITHMS = ("ring", "ps", "hierarchical")
TCP_SHARE = 0.80      # of the line rate a ring over TCP sockets reaches
RDMA_SHARE = 0.95     # ... over RDMA (RoCE, InfiniBand): headers only
BACKWARD_SHARE = 2 / 3    # backward is about twice the forward's arithmetic
FUSION_BYTES = 64 << 20   # HVDLITE_FUSION_THRESHOLD's default


@dataclass(frozen=True)
class Link:
    """What a ring reaches on one link: bytes/s each way, seconds per message."""
    name: str
    bandwidth: float
    latency: float
    note: str = ""
    max_ranks: Optional[int] = None     # links inside one node reach no further

    def describe(self) -> str:
        return (f"{self.name} ({self.note}: {self.bandwidth / 1e9:.3g} GB/s, "
                f"{self.latency * 1e6:g} us per message)")


def _wire(name: str, gbit: float, share: float, latency_us: float, note: str) -> Link:
    return Link(name, gbit * 1e9 / 8 * share, latency_us * 1e-6, note)


NETWORKS: dict[str, Link] = {link.name: link for link in (
    _wire("25GbE", 25, TCP_SHARE, 10, "25 Gb/s Ethernet, TCP"),
    _wire("25GbE-RoCE", 25, RDMA_SHARE, 2, "25 Gb/s Ethernet, RDMA"),
    _wire("100GbE", 100, TCP_SHARE, 10, "100 Gb/s Ethernet, TCP"),
    _wire("IB-EDR", 100, RDMA_SHARE, 2, "InfiniBand EDR, 100 Gb/s"),
    _wire("IB-HDR", 200, RDMA_SHARE, 2, "InfiniBand HDR, 200 Gb/s"),
    Link("NVLink", 130e9, 2e-6, "NVLink 2, six links, inside one node", max_ranks=8),
    Link("PCIe", 10e9, 5e-6, "PCIe 3.0 x16 between GPUs, inside one node", max_ranks=8),
)}


def network(name: str, flag: str = "--network") -> Link:
    """A named link, or a ConfigError naming ``flag`` (the option that gave the name)
    and listing the names."""
    for known, link in NETWORKS.items():
        if known.lower() == name.strip().lower():
            return link
    instead = ", or give --bandwidth (GB/s) and --latency (us)" if flag == "--network" else ""
    raise ConfigError(f"{flag} {name!r} is not a network the forecast knows; use one of "
                      f"{', '.join(NETWORKS)}{instead}")


def custom_link(bandwidth_gbs: float, latency_us: float, name: str = "custom") -> Link:
    if not (math.isfinite(bandwidth_gbs) and bandwidth_gbs > 0):
        raise ConfigError(f"--bandwidth must be a finite number above 0 (GB/s), got "
                          f"{bandwidth_gbs}")
    if not (math.isfinite(latency_us) and latency_us >= 0):
        raise ConfigError(f"--latency must be a finite number, 0 or more (us), got {latency_us}")
    return Link(name, bandwidth_gbs * 1e9, latency_us * 1e-6, "given")


def formula_bytes(algorithm: str, nbytes: int, size: int) -> Optional[int]:
    """Bytes the busiest rank sends (and receives) in one allreduce of ``nbytes``."""
    if algorithm == "ps":
        return nbytes * (size - 1)
    if algorithm == "ring":
        return 2 * nbytes * (size - 1) // size
    return None


@dataclass(frozen=True)
class Cost:
    """One allreduce of n bytes takes ``latency + per_byte * n`` seconds."""
    latency: float
    per_byte: float


def allreduce_cost(algorithm: str, size: int, link: Link, intra: Optional[Link] = None,
                   per_node: int = 1) -> Cost:
    """The alpha-beta cost above. A ring or server spanning nodes waits on the
    slowest link, the network; inside one node (size <= per_node) it is ``intra``."""
    if size <= 1:
        return Cost(0.0, 0.0)
    inside = intra is not None and size <= per_node
    wire = intra if inside and intra is not None else link
    if algorithm == "ring":
        return Cost(2 * (size - 1) * wire.latency, 2 * (size - 1) / (size * wire.bandwidth))
    if algorithm == "ps":
        return Cost(2 * (size - 1) * wire.latency, 2 * (size - 1) / wire.bandwidth)
    if algorithm != "hierarchical":
        raise ConfigError(f"unknown algorithm {algorithm!r}; use one of {', '.join(ALGORITHMS)}")
    local = min(per_node, size) if intra is not None else 1
    nodes = math.ceil(size / local)
    near = intra if intra is not None else link
    return Cost(2 * (local - 1) * near.latency + 2 * (nodes - 1) * link.latency,
                2 * (local - 1) / (local * near.bandwidth)
                + 2 * (nodes - 1) / (nodes * link.bandwidth))


def sync_z(size: int) -> float:
    """Expected maximum of ``size`` standard normals (Blom): how many standard
    deviations the slowest rank's step lies above the mean. 0 for one rank."""
    return NormalDist().inv_cdf((size - 0.375) / (size + 0.25))


@dataclass(frozen=True)
class Workload:
    """One rank's step, as a report or the user gives it (seconds and bytes)."""
    compute_s: float                # a step without waiting for communication
    grad_bytes: float               # reduced per step, every bucket together
    buckets: Optional[int] = None   # reductions per step while gradients stream in
    fusion_bytes: float = FUSION_BYTES
    backward_share: float = BACKWARD_SHARE
    overlap: float = 1.0            # share of backward that can hide communication
    step_sd_s: float = 0.0          # step-to-step standard deviation of compute
    cycle_s: float = 0.0            # a bucket waits this long to fill (Horovod's 5 ms cycle)
    batch: Optional[float] = None   # samples per rank per step

    def check(self) -> "Workload":
        for field, what, ok, wanted, flag in _CHECKS:
            value = getattr(self, field)
            if value is not None and not (is_number(value) and ok(value)):
                raise ConfigError(f"the workload's {what} must be {wanted}, a finite "
                                  f"number; got {value!r} (give {flag})")
        return self


def is_number(value: Any) -> bool:
    """A finite int or float. Not a bool (JSON's true would count as 1 second of
    compute), not NaN (it fails every comparison, so no range check would refuse it),
    not infinity (the bucket count would overflow)."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


# Workload field, what it is, the test, what it must be, the flag that sets it.
_CHECKS: tuple[tuple[str, str, Callable[[Any], bool], str, str], ...] = (
    ("compute_s", "compute time per step (s)", lambda v: v > 0, "above 0", "--compute-ms"),
    ("grad_bytes", "gradient bytes", lambda v: v >= 0, "0 or more",
     "--grad-bytes or --params"),
    ("buckets", "buckets", lambda v: v >= 1, "at least 1", "--buckets or --tensors"),
    ("fusion_bytes", "fusion threshold", lambda v: v > 0, "above 0", "--fusion-bytes"),
    ("backward_share", "backward share", lambda v: 0 < v <= 1, "in (0, 1]",
     "--backward-share"),
    ("overlap", "overlap", lambda v: 0 <= v <= 1, "in [0, 1]", "--overlap"),
    ("step_sd_s", "step time deviation (s)", lambda v: v >= 0, "0 or more", "--step-sd-ms"),
    ("cycle_s", "cycle time (s)", lambda v: v >= 0, "0 or more", "cycle_s"),
    ("batch", "batch size", lambda v: v > 0, "above 0", "--batch-size"))


def buckets(work: Workload, per_bucket_s: float, overlap: bool) -> int:
    """k(P) in the model above."""
    fewest = max(1, math.ceil(work.grad_bytes / work.fusion_bytes))
    if not overlap:
        return fewest
    measured = work.buckets if work.buckets is not None else fewest
    if per_bucket_s + work.cycle_s <= 0:
        return max(fewest, measured)
    window = work.overlap * work.backward_share * work.compute_s
    paced = math.ceil(window / (per_bucket_s + work.cycle_s))
    return max(fewest, min(measured, max(1, paced)))


def step(work: Workload, size: int, algorithm: str, link: Link, overlap: bool,
         intra: Optional[Link] = None, per_node: int = 1) -> dict[str, Any]:
    """One row of the forecast: seconds per step and where they go, on ``size`` ranks."""
    if size < 1:
        raise ConfigError(f"a forecast needs at least 1 rank, got P = {size}")
    cost = allreduce_cost(algorithm, size, link, intra, per_node)
    near = intra if intra is not None and size <= per_node else link
    negotiation = 2 * math.ceil(math.log2(size)) * near.latency if size > 1 else 0.0
    per_bucket = cost.latency + negotiation
    count = buckets(work, per_bucket, overlap)
    comm = count * per_bucket + cost.per_byte * work.grad_bytes
    if overlap:
        exposed = max(comm - work.overlap * work.backward_share * work.compute_s, comm / count)
    else:
        exposed = comm
    sync = work.step_sd_s * sync_z(size)
    seconds = work.compute_s + exposed + sync
    return {"ranks": size, "algorithm": algorithm, "network": link.name, "overlap": overlap,
            "step_s": seconds, "comm_s": comm, "exposed_s": exposed, "sync_s": sync,
            "buckets": count, "efficiency": work.compute_s / seconds,
            "samples_per_s": None if work.batch is None else size * work.batch / seconds}


# report.json's per-rank field -> (Workload field, what it is, the flag that gives it)
REPORT_FIELDS = {"compute_time_s": ("compute_s", "compute time per step", "--compute-ms"),
                 "allreduce_bytes": ("grad_bytes", "bytes reduced per step", "--grad-bytes"),
                 "allreduce_calls": ("buckets", "reductions (buckets) per step", "--buckets"),
                 "step_time_sd_s": ("step_sd_s", "step time deviation", "--step-sd-ms")}


def workload_from_report(report: Any, source: str = "report.json", **given: Any) -> Workload:
    """A Workload from an HVDLITE_REPORT report.json: per field, the median over the
    ranks that recorded steps. ``given`` Workload fields (not None) replace the report's."""
    given = {k: v for k, v in given.items() if v is not None}
    ranks = report.get("ranks") if isinstance(report, dict) else None
    if not isinstance(ranks, list) or not ranks:
        raise ConfigError(f"{source} has no 'ranks' list: it is not an HVDLITE_REPORT "
                          "report.json; pass the report.json a run wrote, or give "
                          "--compute-ms and --grad-bytes instead")
    measured = [r for r in ranks if isinstance(r, dict) and _steps(r, source)]
    if not measured:
        raise ConfigError(f"{source} recorded no optimizer steps (at least two steps of "
                          "a DistributedOptimizer are needed); train longer, or give "
                          "--compute-ms and --grad-bytes")
    fields = dict(given)
    for name, (field, what, flag) in REPORT_FIELDS.items():
        if field in given:
            continue
        found = sorted(_field(r, name, what, flag, source) for r in measured
                       if r.get(name) is not None)
        if len(found) < len(measured):
            if name == "step_time_sd_s":
                continue            # older reports: no spread, no wait for the slowest
            raise ConfigError(f"{source} has no '{name}' ({what}) for every rank: it was "
                              "written by an hvdlite older than the forecast, or by hand; "
                              f"rerun with HVDLITE_REPORT set, or give {flag}")
        fields[field] = found[len(found) // 2]
    if "grad_bytes" not in given and not fields["grad_bytes"]:
        raise ConfigError(f"{source}: its ranks reduced nothing ('allreduce_bytes' is 0): "
                          "a one-rank Keras or TensorFlow run skips its reductions without "
                          "counting them, and a run without a DistributedOptimizer has none; "
                          "give --grad-bytes (4 bytes per fp32 parameter)")
    if "buckets" not in given:
        fields["buckets"] = max(1, round(fields["buckets"]))
    return Workload(**fields).check()


def _steps(record: dict[str, Any], source: str) -> int:
    """The optimizer steps a rank's record counts: a whole number, 0 or more."""
    steps = record.get("steps", 0)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ConfigError(f"{source}: rank {record.get('rank', '?')}'s 'steps' is {steps!r}, "
                          "not a whole number of optimizer steps (0 or more): the file was "
                          "changed by hand or damaged; use the report.json a run wrote")
    return steps


def _field(record: dict[str, Any], name: str, what: str, flag: str, source: str) -> float:
    """A rank's measured ``name``: a finite number, else a ConfigError naming it."""
    value = record[name]
    if not is_number(value):
        raise ConfigError(f"{source}: rank {record.get('rank', '?')}'s '{name}' is {value!r}, "
                          f"not a finite number ({what}): the file was changed by hand or "
                          f"damaged; use the report.json a run wrote, or give {flag}")
    return value
