"""The bandwidth probe's arithmetic over every rank's timings: the nccl-tests rows, the
straggler scores and the ring links (distdiag/probes/cluster/bandwidth.py runs the timings).

At 16k ranks the writer consolidates 16k x 15 timings and 16k links before the verdict can be
published (issue 21), so each stage is one pass over the ranks with the per-value work done by
C loops (map, zip, sorted, math.fsum); the values are exactly those of the statistics module's
median and fmean, which the code used before (tests/unit/test_check_equivalence.py pins it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from operator import itemgetter, truediv
from typing import Any, Protocol, TypedDict

from distdiag.probes.base import ConsolidationView
from distdiag.report.model import Finding

__all__ = [
    "bus_factor", "format_size", "group_timings", "bandwidth_rows", "straggler_scores", "slow_links", "ranks_named",
    "median_sorted", "sig", "Floors", "BandwidthPlan",
]


class BandwidthPlan(TypedDict):
    """The sweep as run on this device: the options with the device's defaults filled in."""

    sizes: list[int]
    iters: int
    repeats: int
    warmup: int
    p2p_size: int
    p2p_iters: int
    slow_link_factor: float
    slow_link_min_s: float


class Floors(Protocol):
    """What these statistics read of the probe's options (bandwidth.py BandwidthConfig)."""

    expected: dict[int, dict[str, float]]
    """Minimum busbw in GB/s by message size and op."""
    expected_p2p_gbps: float

    def resolved(self, gpu: bool) -> BandwidthPlan: ...


def sig(value: float) -> float:
    """Four significant digits: GB/s on CPU are small numbers, on GPUs large ones."""
    return float(f"{value:.4g}")


def format_size(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return f"{nbytes}B"


def bus_factor(op: str, world: int) -> float:
    """nccl-tests' busbw / algbw for an op on `world` ranks."""
    if op == "all_reduce":
        return 2 * (world - 1) / world
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (world - 1) / world
    if op == "broadcast":
        return 1.0
    raise ValueError(f"unknown op {op!r}")


def median_sorted(values: Sequence[float]) -> float:
    """statistics.median of an already sorted sequence (the same value, without its copy and sort)."""
    n = len(values)
    if n % 2:
        return values[n // 2]
    return (values[n // 2 - 1] + values[n // 2]) / 2


def group_timings(payloads: dict[int, dict[str, Any]]) -> dict[tuple[str, int], list[tuple[int, dict[str, Any]]]]:
    """Every (op, size)'s (rank, sample) pairs, ranks ascending; the keys in the order the
    ranks list them."""
    by_key: dict[tuple[str, int], list[tuple[int, dict[str, Any]]]] = {}
    for rank in sorted(payloads):
        for s in payloads[rank]["samples"]:
            by_key.setdefault((s["op"], s["size"]), []).append((rank, s))
    return by_key


def bandwidth_rows(
    payloads: dict[int, dict[str, Any]], n: int, opts: Floors,
    by_key: dict[tuple[str, int], list[tuple[int, dict[str, Any]]]] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One nccl-tests row per (op, size), and the busbw metrics."""
    rows = []
    busbw: dict[str, dict[str, float]] = {}
    for (op, size), pairs in (by_key if by_key is not None else group_timings(payloads)).items():
        samples = [s for _, s in pairs]
        # Per timed loop, the mean over ranks of the loop time per call (nccl-tests' time);
        # the row is the median loop. fsum / count is statistics.fmean.
        totals = [s.get("totals_s") or [s["total_s"]] for s in samples]  # one loop in older payloads
        iters = [s["iters"] for s in samples]
        loops = min(map(len, totals))
        times = sorted(math.fsum(map(truediv, map(itemgetter(j), totals), iters)) / len(totals) for j in range(loops))
        t = median_sorted(times)
        nbytes = samples[0]["bytes"]
        algbw = nbytes / t / 1e9
        bus = algbw * bus_factor(op, n)
        want = opts.expected.get(size, {}).get(op)
        rows.append({
            "op": op, "size": format_size(size), "bytes": nbytes, "time_us": round(t * 1e6, 1),
            "algbw_GBps": sig(algbw), "busbw_GBps": sig(bus),
            "loops": loops, "spread_pct": round((times[-1] - times[0]) / t * 100, 1),
            **({"expected_GBps": want} if want else {}),
        })
        busbw.setdefault(op, {})[format_size(size)] = sig(bus)
    return rows, {"busbw_GBps": busbw}


def _lateness(op: str, size: int, samples: dict[int, dict[str, Any]]) -> tuple[list[float], list[float]]:
    """Per rank of `samples` (in its order): (score, seconds late) at one (op, size)."""
    values = list(samples.values())
    incalls = list(map(itemgetter("incall_s"), values))
    # The upper median: with 2 ranks it is the one that waited, so the late one scores.
    reference = sorted(incalls)[len(incalls) // 2]
    iteration = median_sorted(sorted(map(truediv, map(itemgetter("total_s"), values), map(itemgetter("iters"), values))))
    # max(0.0, reference - x): x < reference exactly when the difference is positive.
    lates = [reference - x if x < reference else 0.0 for x in incalls]
    scores = [late / iteration for late in lates] if iteration > 0 else [0.0] * len(lates)
    return scores, lates


def _score(scores: Sequence[float], lates: Sequence[float], labels: Sequence[str]) -> dict[str, Any]:
    """One rank's entry from its (score, late, label) per timing."""
    worst = max(zip(scores, lates, labels, strict=True))
    return {
        "score": median_sorted(sorted(scores)),
        "late_s": median_sorted(sorted(lates)),
        "samples": len(scores),
        "worst": f"{worst[2]} (score {worst[0]:.2f}, {worst[1] * 1e3:.2f} ms late)",
    }


def straggler_scores(
    payloads: dict[int, dict[str, Any]],
    by_key: dict[tuple[str, int], list[tuple[int, dict[str, Any]]]] | None = None,
) -> dict[int, dict[str, Any]]:
    """Per rank: median over (op, size) of its lateness / the median iteration time.

    Per (op, size) one pass over its ranks; then per rank its few values, gathered by zip when
    every timing has the same ranks (the usual case), else one list per rank."""
    columns = []
    for (op, size), pairs in (by_key if by_key is not None else group_timings(payloads)).items():
        samples = dict(pairs)  # a rank listing a timing twice: its last one
        if len(samples) >= 2:
            columns.append((list(samples), f"{op} {format_size(size)}", *_lateness(op, size, samples)))
    if not columns:
        return {}
    ranks = columns[0][0]
    labels = [c[1] for c in columns]
    if all(c[0] == ranks for c in columns):
        per_rank = zip(ranks, zip(*(c[2] for c in columns), strict=True), zip(*(c[3] for c in columns), strict=True), strict=True)
        return {r: _score(scores, lates, labels) for r, scores, lates in per_rank}
    items: dict[int, tuple[list[float], list[float], list[str]]] = {}
    for ranks_k, label, scores, lates in columns:
        for r, score, late in zip(ranks_k, scores, lates, strict=True):
            mine = items.setdefault(r, ([], [], []))
            mine[0].append(score)
            mine[1].append(late)
            mine[2].append(label)
    return {r: _score(*items[r]) for r in sorted(items)}


def slow_links(
    links: list[dict[str, Any]], n: int, opts: Floors, view: ConsolidationView, gpu: bool = False
) -> tuple[list[dict[str, Any]], list[Finding]]:
    """Ring-link rows, and findings for links much slower than the reference link."""
    pairs: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for link in links:
        pairs.setdefault(tuple(link["pair"]), []).append(link)
    times = {pair: max(x["time_s"] for x in items) for pair, items in pairs.items()}
    if not times:
        return [], []
    nbytes = links[0]["bytes"]
    ordered = sorted(times.values())
    # The 25th-percentile link: with one bad rank two of the ring's links are slow, so the
    # median itself would be slow on small rings.
    reference = ordered[len(ordered) // 4]
    rows, slow = _link_rows(times, nbytes, reference, opts, view, gpu)
    evidence = "; ".join(f"{row['link']} ({row['hosts']}): {row['GBps']} GB/s" for row in rows)
    findings, named = _slow_rank_findings(slow, times, nbytes, reference, n, opts, view, evidence)
    findings += _slow_pair_findings([p for p in slow if p not in named], times, nbytes, reference, opts, view, evidence)
    return rows, findings


def _link_rows(
    times: dict[tuple[int, int], float], nbytes: int, reference: float, opts: Floors,
    view: ConsolidationView, gpu: bool,
) -> tuple[list[dict[str, Any]], list[tuple[int, int]]]:
    """One row per ring link, and the links that are slow against the reference or the expected rate."""
    plan = opts.resolved(gpu)
    factor, floor = plan["slow_link_factor"], plan["slow_link_min_s"]
    rows = []
    slow: list[tuple[int, int]] = []
    for (a, b), t in sorted(times.items()):
        gbps = nbytes / t / 1e9
        is_slow = len(times) >= 3 and t > factor * reference and t - reference > floor
        below = opts.expected_p2p_gbps and gbps < opts.expected_p2p_gbps
        rows.append({
            "link": f"{a}<->{b}", "hosts": f"{view.host_of(a)}<->{view.host_of(b)}", "size": format_size(nbytes),
            "time_us": round(t * 1e6, 1), "GBps": sig(gbps), "vs_ref": round(t / reference, 2),
        })
        if is_slow or below:
            slow.append((a, b))
    return rows, slow


def _slow_rank_findings(
    slow: list[tuple[int, int]], times: dict[tuple[int, int], float], nbytes: int, reference: float, n: int,
    opts: Floors, view: ConsolidationView, evidence: str,
) -> tuple[list[Finding], set[tuple[int, int]]]:
    """A finding per rank whose two ring links are both slow, and the links those findings name."""
    findings = []
    # Each rank's slow links, in `slow`'s order: one pass, not a scan of `slow` per rank.
    count: dict[int, int] = {}
    links_of: dict[int, list[tuple[int, int]]] = {}
    for pair in slow:
        for r in pair:
            count[r] = count.get(r, 0) + 1
        for r in dict.fromkeys(pair):
            links_of.setdefault(r, []).append(pair)
    both = {r for r, c in count.items() if c >= 2 and n >= 3}
    named: set[tuple[int, int]] = set()
    for r in sorted(both):
        mine = links_of[r]
        named.update(mine)
        findings.append(Finding(
            severity="error" if opts.expected_p2p_gbps else "warning",
            issue=(f"rank {r} (host {view.host_of(r)}): both its ring links are slow: "
                   + ", ".join(f"{a}<->{b} {times[(a, b)] * 1e6:.0f} us" for a, b in mine)
                   + f" vs {reference * 1e6:.0f} us for the reference link ({format_size(nbytes)} each way)"),
            evidence=evidence,
            ranks=[r],
            fix="the rank itself is slow (its NIC, its PCIe link, or a busy host): check that host and its device",
            confidence=0.8,
        ))
    return findings, named


def _slow_pair_findings(
    pairs: list[tuple[int, int]], times: dict[tuple[int, int], float], nbytes: int, reference: float,
    opts: Floors, view: ConsolidationView, evidence: str,
) -> list[Finding]:
    """A finding per slow link not already blamed on one of its ranks."""
    findings = []
    for a, b in pairs:
        gbps = nbytes / times[(a, b)] / 1e9
        why = (f"{gbps:.3f} GB/s, below the expected {opts.expected_p2p_gbps} GB/s"
               if opts.expected_p2p_gbps and gbps < opts.expected_p2p_gbps
               else f"{times[(a, b)] / reference:.1f}x the reference link's time")
        findings.append(Finding(
            severity="error" if opts.expected_p2p_gbps and gbps < opts.expected_p2p_gbps else "warning",
            issue=f"slow link between rank {a} (host {view.host_of(a)}) and rank {b} (host {view.host_of(b)}): {why}",
            evidence=evidence,
            ranks=[a, b],
            fix="test that pair's path (NIC, cable, switch port, NVLink) with a point-to-point benchmark and reseat or drain",
            confidence=0.7,
        ))
    return findings


def ranks_named(findings: list[Finding]) -> list[int]:
    return sorted({r for f in findings for r in f.ranks})


