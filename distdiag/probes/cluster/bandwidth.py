"""`bandwidth`: time, algbw and busbw per collective and message size; stragglers; slow links.

Conventions are nccl-tests' (doc/PERFORMANCE.md there), so numbers compare with theirs:
the message size S is the all_reduce/broadcast buffer, the all_gather output, the
reduce_scatter input and the all_to_all send buffer; time is the mean over ranks of each
rank's loop time / iterations, the median of `repeats` such loops; algbw = S / time;
busbw = algbw x 2(n-1)/n for all_reduce, x (n-1)/n for all_gather, reduce_scatter and
all_to_all, x 1 for broadcast. Reported per size, never averaged over sizes.

Who is slow, which collective timing alone cannot say (a ring waits for its slowest member
everywhere), is found two ways:
- straggler score: each rank times its own wait inside every collective call. A rank that
  arrives late waits least; its lateness is the median rank's in-call time minus its own,
  and its score is that lateness over the median iteration time (0: on time, ~1: the others
  spent the whole iteration waiting for it). The per-rank score is the median over every
  (op, size), so one op's quirk (a broadcast root never waits) does not name anyone.
- a ring of point-to-point exchanges between neighbours, one pair at a time, so only one
  link is loaded: a link much slower than the others names its two ranks and hosts; a rank
  both of whose links are slow is named alone.
"""

from __future__ import annotations

import functools
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from distdiag.errors import ConfigError
from distdiag.probes.base import ConsolidationView, Probe
from distdiag.probes.cluster.bandwidth_stats import (
    BandwidthPlan,
    bandwidth_rows,
    bus_factor,
    format_size,
    group_timings,
    ranks_named,
    slow_links,
    straggler_scores,
)
from distdiag.report.model import Finding, ProbeResult
from distdiag.runtime.comm import ALL_GATHER_SINGLE, REDUCE_SCATTER_SINGLE, Comm

if TYPE_CHECKING:
    from distdiag.runtime.context import RankContext

__all__ = [
    "BandwidthConfig",
    "BandwidthProbe",
    "OPS",
    "bus_factor",
    "parse_size",
    "format_size",
    "straggler_scores",
    "slow_links",
]

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
CPU_SIZES = ("4KiB", "256KiB", "4MiB")
GPU_SIZES = ("1MiB", "32MiB", "256MiB", "1GiB")
CPU_FLOOR_MAX = 16 * 2**20
"""On CPU, a size that only an expected_busbw_gbps floor names runs up to this: the floors of a
GPU cluster's config (256MiB, 1GiB) would take minutes per op on CPU, past the gate's
deadline. A size listed in `sizes` always runs."""
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
# The timed loop's record uses the names comm.py gives the same calls in the warm-up.
_TRACKED_NAME = {"all_gather": "all_gather_into_tensor", "reduce_scatter": "reduce_scatter_tensor",
                 "all_to_all": "all_to_all_single"}
_ELEM = 4  # float32: the element nccl-tests' default runs use


def parse_size(value: object, key: str = "probes.bandwidth.sizes") -> int:
    """4096, "4096", "4KiB", "1MB" -> bytes; anything else is a ConfigError naming the key."""
    if isinstance(value, int) and not isinstance(value, bool):
        nbytes = value
    elif isinstance(value, str) and (m := re.fullmatch(r"\s*(\d+)\s*([KMG]i?B|B)?\s*", value, re.IGNORECASE)):
        nbytes = int(m.group(1)) * _UNITS[(m.group(2) or "").upper()]
    else:
        raise ConfigError(f"{key}: cannot read size {value!r}; use bytes (4096) or a unit (4KiB, 64MiB, 1GB)")
    if not 1 <= nbytes <= 2**36:
        raise ConfigError(f"{key}: size {value!r} must be within [1 B, 64 GiB]")
    return nbytes


@dataclass
class BandwidthConfig:
    """Options of the bandwidth probe, the `[probes.bandwidth]` table."""

    sizes: list[int | str] = field(default_factory=list)
    """Message sizes (bytes or "4KiB", "64MiB"); empty: 4KiB..4MiB on CPU, 1MiB..1GiB on GPU."""
    ops: list[str] = field(default_factory=lambda: list(OPS))
    """Collectives to time: all_reduce, all_gather, reduce_scatter, all_to_all, broadcast."""
    iters: int = 0
    """Timed iterations per (op, size); 0: 8 on CPU, 20 on GPU."""
    repeats: int = 0
    """Timed loops of `iters` calls per (op, size); the row reports the median loop, so one
    descheduled loop does not set the number. 0: 3 on CPU, 1 on GPU (nccl-tests' single loop)."""
    warmup: int = 0
    """Untimed iterations before each timed loop; 0: 2 on CPU, 5 on GPU."""
    expected_busbw_gbps: dict[str, Any] = field(default_factory=dict)
    """Minimum busbw in GB/s (1e9 B/s) per size: {"64MiB" = 150} for every op, or
    {"64MiB" = {all_reduce = 150, all_gather = 120}} per op. Sizes named here join the sweep
    (on CPU only up to 16MiB unless `sizes` lists them; a floor not run is said in an info finding)."""
    p2p: bool = True
    """Also run the ring of neighbour exchanges that names a slow link (needs >= 2 ranks)."""
    p2p_size: int | str = ""
    """Bytes each way per ring exchange; empty: 1MiB on CPU, 64MiB on GPU."""
    p2p_iters: int = 0
    """Timed exchanges per ring link; 0: 5 on CPU, 10 on GPU."""
    expected_p2p_gbps: float = 0.0
    """Minimum GB/s of each ring link (one direction); 0 disables the check."""
    straggler_score: float = 0.3
    """Name a rank whose straggler score (its lateness / the median iteration) is above this."""
    straggler_min_late_s: float = 0.0002
    """...and whose median lateness is above this many seconds (scheduling noise is not a straggler)."""
    slow_link_factor: float = 0.0
    """Name a ring link slower than this many times the reference (25th-percentile) link;
    0: 2 on GPUs, 4 on CPU (a shared CPU host's exchanges vary 2x from scheduling alone)."""
    slow_link_min_s: float = 0.0
    """...and whose median exchange is at least this many seconds slower than the reference;
    0: 0.2 ms on GPUs, 5 ms on CPU (a rank descheduled on a busy host loses whole time slices)."""
    delay_rank: int = -1
    """Fault injection for tests and demos: this rank sleeps `delay_s` before every timed call."""
    delay_s: float = 0.0
    """Seconds the `delay_rank` sleeps before every timed call (a straggler on purpose)."""

    def __post_init__(self) -> None:
        p = "probes.bandwidth"
        if not isinstance(self.sizes, list):
            raise ConfigError(f"{p}.sizes must be a list of sizes, got {self.sizes!r}")
        self.sizes = [parse_size(s, f"{p}.sizes") for s in self.sizes]
        if not isinstance(self.ops, list) or not self.ops or any(o not in OPS for o in self.ops):
            raise ConfigError(f"{p}.ops must name some of {', '.join(OPS)}, got {self.ops!r}")
        for key in ("iters", "warmup", "repeats", "p2p_iters"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 10_000:
                raise ConfigError(f"{p}.{key} must be an integer in [0, 10000] (0: the device's default), got {value!r}")
        if not isinstance(self.p2p, bool):
            raise ConfigError(f"{p}.p2p must be true or false, got {self.p2p!r}")
        self.p2p_size = parse_size(self.p2p_size, f"{p}.p2p_size") if self.p2p_size not in ("", 0) else 0
        if not isinstance(self.expected_busbw_gbps, dict):
            raise ConfigError(f"{p}.expected_busbw_gbps must be a table of size = GB/s, got {self.expected_busbw_gbps!r}")
        expected: dict[int, dict[str, float]] = {}
        for size, want in self.expected_busbw_gbps.items():
            nbytes = parse_size(size, f"{p}.expected_busbw_gbps")
            table = want if isinstance(want, dict) else {op: want for op in OPS}
            for op, gbps in table.items():
                if op not in OPS:
                    raise ConfigError(f"{p}.expected_busbw_gbps.{size}: unknown op {op!r}; known: {', '.join(OPS)}")
                if isinstance(gbps, bool) or not isinstance(gbps, int | float) or not gbps > 0:
                    raise ConfigError(f"{p}.expected_busbw_gbps.{size}.{op} must be GB/s > 0, got {gbps!r}")
                expected.setdefault(nbytes, {})[op] = float(gbps)
        self.expected = expected
        for key in ("expected_p2p_gbps", "straggler_score", "straggler_min_late_s", "slow_link_min_s", "delay_s"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise ConfigError(f"{p}.{key} must be a number >= 0, got {value!r}")
        f = self.slow_link_factor
        if isinstance(f, bool) or not isinstance(f, int | float) or not (f == 0 or f > 1):
            raise ConfigError(f"{p}.slow_link_factor must be a number > 1 (0: the device's default), got {f!r}")
        if isinstance(self.delay_rank, bool) or not isinstance(self.delay_rank, int):
            raise ConfigError(f"{p}.delay_rank must be a rank number (-1: none), got {self.delay_rank!r}")

    def resolved(self, gpu: bool) -> BandwidthPlan:
        """Defaults that depend on the device, filled in."""
        floors = {s for s in self.expected if gpu or s <= CPU_FLOOR_MAX}
        # sizes and p2p_size hold bytes once __post_init__ has read them (parse_size keeps an int as it is)
        sizes = {parse_size(s) for s in self.sizes or (GPU_SIZES if gpu else CPU_SIZES)} | floors
        return {
            "sizes": sorted(sizes),
            "iters": self.iters or (20 if gpu else 8),
            "repeats": self.repeats or (1 if gpu else 3),
            "warmup": self.warmup or (5 if gpu else 2),
            "p2p_size": parse_size(self.p2p_size or ("64MiB" if gpu else "1MiB")),
            "p2p_iters": self.p2p_iters or (10 if gpu else 5),
            "slow_link_factor": self.slow_link_factor or (2.0 if gpu else 4.0),
            "slow_link_min_s": self.slow_link_min_s or (0.0002 if gpu else 0.005),
        }


class _Timer:
    """Per-call in-call times and a loop total, on CPU (perf_counter) or CUDA (events)."""

    def __init__(self, device: torch.device, iters: int) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.events = [
                (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)
            ]
        self.incall: list[float] = []

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def call(self, i: int, fn: Callable[[], object]) -> None:
        if self.cuda:
            # Events on the stream: the kernel's time including its wait for late peers.
            self.events[i][0].record()
            fn()
            self.events[i][1].record()
            return
        start = time.perf_counter()
        fn()
        self.incall.append(time.perf_counter() - start)

    def incall_times(self) -> list[float]:
        if self.cuda:
            return [a.elapsed_time(b) / 1000.0 for a, b in self.events]
        return self.incall


def _op_call(ctx: RankContext, op: str, size: int,
             device: torch.device) -> tuple[Callable[[], object], Callable[[], object], torch.Tensor, int]:
    """Two closures issuing one `op` of nccl-tests size ~`size` (bare, tracked), its input,
    and the exact size it moves.

    The bare one calls torch.distributed directly, so the timed loop is as lean as a plain
    loop of the collective (distdiag's per-call tracking would add its own microseconds to
    every small message); the probe tracks each timed loop as one collective instead. The
    tracked one (comm's wrapper: call site, sequence, fault injection) runs the warm-up.
    """
    n, comm = ctx.world_size, ctx.comm
    if op in ("all_reduce", "broadcast"):
        count = max(1, size // _ELEM)
        buf = torch.ones(count, dtype=torch.float32, device=device)
        if op == "all_reduce":
            return (lambda: dist.all_reduce(buf)), (lambda: comm.all_reduce(buf)), buf, count * _ELEM
        return (lambda: dist.broadcast(buf, src=0)), (lambda: comm.broadcast(buf, src=0)), buf, count * _ELEM
    per_rank = max(1, size // (_ELEM * n))
    small = torch.ones(per_rank, dtype=torch.float32, device=device)
    big = torch.ones(per_rank * n, dtype=torch.float32, device=device)
    nbytes = per_rank * n * _ELEM
    if op == "all_gather":
        return (lambda: ALL_GATHER_SINGLE(big, small)), (lambda: comm.all_gather_into_tensor(big, small)), small, nbytes
    if op == "reduce_scatter":
        return (lambda: REDUCE_SCATTER_SINGLE(small, big)), (lambda: comm.reduce_scatter_tensor(small, big)), big, nbytes
    out = torch.empty_like(big)
    return (lambda: dist.all_to_all_single(out, big)), (lambda: comm.all_to_all_single(out, big)), big, nbytes


def _timed_loop(comm: Comm, timer: _Timer, iters: int, fn: Callable[[], object], delay: float,
                record: tuple[str, torch.Tensor, str] | None = None) -> float:
    """`iters` back-to-back calls of `fn` and a device sync; returns the loop's seconds.

    `record` (op, tensor, detail): the loop is one tracked collective (fn is a bare
    torch.distributed call) and a process-level injected fault (hang, raise, exit) due at
    that collective fires before it. The sentinel ticks slowly meanwhile (Tracker.timed).
    `delay` (the straggler fault) sleeps outside the record, so a rank stuck there is named
    as not in a collective.
    """
    tracker = comm.tracker
    rec = None
    if record is not None:
        if comm.faults:
            comm.faults.at(tracker.probe_name, tracker.collectives_in_probe)
        rec = tracker.begin(*record[:2], "world", record[2])
    try:
        with tracker.timed():
            started = time.perf_counter()
            for i in range(iters):
                if delay:
                    tracker.in_collective = None
                    time.sleep(delay)
                    tracker.in_collective = rec
                timer.call(i, fn)
            timer.sync()
            return time.perf_counter() - started
    finally:
        if rec is not None:
            tracker.end(rec)


class BandwidthProbe(Probe):
    name = "bandwidth"
    times_ranks = True  # its straggler score is each rank's lateness: nothing else runs on rank 0 meanwhile
    summary = "slow collectives per op and size (time, algbw, busbw as nccl-tests), straggler ranks, slow links between ranks"
    min_world_size = 2
    default_enabled = False
    """Costs seconds to minutes: runs only when a profile or --probes asks for it."""
    Config = BandwidthConfig

    def run(self, ctx: RankContext) -> dict[str, Any]:
        opts: BandwidthConfig = self.options(ctx)
        device = ctx.device
        plan = opts.resolved(device.type == "cuda")
        delay = opts.delay_s if ctx.rank == opts.delay_rank else 0.0
        samples = []
        for op in opts.ops:
            for size in plan["sizes"]:
                fn, tracked, tensor, nbytes = _op_call(ctx, op, size, device)
                for _ in range(plan["warmup"]):
                    tracked()
                totals, incall = [], []
                for _ in range(plan["repeats"]):
                    timer = _Timer(device, plan["iters"])
                    timer.sync()
                    ctx.comm.barrier()
                    totals.append(_timed_loop(
                        ctx.comm, timer, plan["iters"], fn, delay,
                        (_TRACKED_NAME.get(op, op), tensor, f"{format_size(size)} timed x{plan['iters']}"),
                    ))
                    incall += timer.incall_times()
                samples.append({
                    "op": op, "size": size, "bytes": nbytes, "iters": plan["iters"], "totals_s": totals,
                    "total_s": statistics.median(totals), "incall_s": statistics.median(incall),
                })
                del fn, tracked, tensor
        links = self._ring(ctx, plan, delay) if opts.p2p else []
        return {"samples": samples, "links": links, "gpu": device.type == "cuda"}

    def _ring(self, ctx: RankContext, plan: BandwidthPlan, delay: float) -> list[dict[str, Any]]:
        """Exchange with each neighbour in turn; one pair at a time (a chain, no deadlock)."""
        rank, n, device = ctx.rank, ctx.world_size, ctx.device
        steps = [0] if n == 2 else list(range(n))
        count = max(1, plan["p2p_size"] // _ELEM)
        send = torch.ones(count, dtype=torch.float32, device=device)
        recv = torch.empty_like(send)
        out = []
        for step in steps:
            a, b = step, (step + 1) % n
            if rank not in (a, b):
                continue
            peer = b if rank == a else a
            ctx.comm.send_recv(send, peer, recv, peer)  # warm-up; also waits for the previous pair
            timer = _Timer(device, plan["p2p_iters"])
            timer.sync()
            loop_s = _timed_loop(
                ctx.comm, timer, plan["p2p_iters"], functools.partial(ctx.comm.send_recv, send, peer, recv, peer), delay
            )
            # The fastest exchange: a slow link is slow every time, while scheduling noise on a
            # loaded host only ever adds time (the median still caught 20x bursts in CI here).
            out.append({"pair": [a, b], "bytes": count * _ELEM, "time_s": min(timer.incall_times()),
                        "mean_s": loop_s / plan["p2p_iters"]})
        return out

    def consolidate(self, payloads: dict[int, dict[str, Any]], view: ConsolidationView) -> ProbeResult:
        opts: BandwidthConfig = self.options(view)
        n = view.world_size
        by_key = group_timings(payloads)
        rows, metrics = bandwidth_rows(payloads, n, opts, by_key)
        findings: list[Finding] = []
        scores = straggler_scores(payloads, by_key)
        stragglers = {
            r: s for r, s in scores.items()
            if s["score"] > opts.straggler_score and s["late_s"] > opts.straggler_min_late_s
        }
        for r, s in sorted(stragglers.items()):
            findings.append(Finding(
                severity="warning",
                issue=(f"rank {r} (host {view.host_of(r)}) is a straggler: the other ranks waited "
                       f"{s['late_s'] * 1e3:.2f} ms for it per collective, {s['score']:.0%} of the median iteration"),
                evidence=f"median over {s['samples']} (op, size) timings; worst: {s['worst']}",
                ranks=[r],
                fix="check that rank's host for CPU contention, throttling (the gpu probe), or a process sharing its device",
                confidence=0.8,
            ))
        links = [link for p in payloads.values() for link in p.get("links", [])]
        gpu = any(p.get("gpu") for p in payloads.values())
        link_rows, link_findings = slow_links(links, n, opts, view, gpu)
        findings += link_findings
        if opts.expected:
            findings += _expected_findings(rows, opts, view, sorted(stragglers) or ranks_named(link_findings))
            findings += _floors_not_run(rows, opts)
        details: dict[str, Any] = {"table:bandwidth": rows}
        if link_rows:
            details["table:ring links"] = link_rows
        details["table:straggler scores"] = [
            {"rank": r, "host": view.host_of(r), "score": round(s["score"], 3), "late_ms": round(s["late_s"] * 1e3, 3)}
            for r, s in sorted(scores.items())
        ]
        plan = opts.resolved(gpu)
        # the limits the findings above were judged by, for `distdiag gate --chart` to draw
        details["limits"] = {
            "straggler_score": opts.straggler_score, "straggler_min_late_ms": opts.straggler_min_late_s * 1e3,
            "slow_link_factor": plan["slow_link_factor"], "slow_link_min_us": plan["slow_link_min_s"] * 1e6,
            "expected_p2p_gbps": opts.expected_p2p_gbps,
        }
        metrics["max_straggler_score"] = round(max((s["score"] for s in scores.values()), default=0.0), 3)
        return ProbeResult.from_findings(self.name, findings, metrics=metrics, details=details)


def _floors_not_run(rows: list[dict[str, Any]], opts: BandwidthConfig) -> list[Finding]:
    """An info finding naming the expected_busbw_gbps sizes this run did not time (on CPU,
    floors above CPU_FLOOR_MAX): a floor left unchecked is said, never passed in silence."""
    run = {row["size"] for row in rows}
    left = [format_size(s) for s in sorted(opts.expected) if format_size(s) not in run]
    if not left:
        return []
    return [Finding(
        severity="info",
        issue=(f"expected_busbw_gbps at {', '.join(left)} not checked: on CPU a size only a floor names "
               f"runs up to {format_size(CPU_FLOOR_MAX)}"),
        evidence=f"sizes timed: {', '.join(sorted(run, key=parse_size)) or 'none'}",
        ranks=[],
        fix="run the gate on the GPU nodes these floors are for, or list the size in probes.bandwidth.sizes to time it on CPU",
        confidence=1.0,
    )]


def _expected_findings(
    rows: list[dict[str, Any]], opts: BandwidthConfig, view: ConsolidationView, suspects: list[int]
) -> list[Finding]:
    from distdiag.report.render import format_ranks

    ranks = suspects or list(range(view.world_size))
    hosts = sorted({view.host_of(r) for r in ranks})
    out = []
    for row in rows:
        want = row.get("expected_GBps")
        if want and row["busbw_GBps"] < want:
            out.append(Finding(
                severity="error",
                issue=(f"{row['op']} at {row['size']}: busbw {row['busbw_GBps']:.3f} GB/s is below the expected "
                       f"{want} GB/s on {view.world_size} ranks; "
                       + (f"suspects: {format_ranks(suspects)} on host(s) {', '.join(hosts)}" if suspects
                          else f"hosts {', '.join(hosts)}")),
                evidence=f"time {row['time_us']} us per call for {row['bytes']} bytes, algbw {row['algbw_GBps']} GB/s",
                ranks=ranks,
                fix="see the straggler and ring-link findings for which rank or link; rerun nccl-tests on the named hosts",
                confidence=0.9 if suspects else 0.6,
            ))
    return out
