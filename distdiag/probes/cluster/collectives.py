"""`collectives`: every collective the training stack uses, checked against closed-form results.

Each rank fills its inputs from a formula of (rank, index), so the correct output of every
op is known in closed form on every rank; a wrong result names the rank, op, dtype, group
and the error, instead of "the loss looks off".
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from distdiag.errors import ConfigError
from distdiag.probes.base import ConsolidationView, Probe
from distdiag.report.model import Finding, ProbeResult
from distdiag.runtime.comm import Comm, group_name

if TYPE_CHECKING:
    from distdiag.runtime.context import RankContext

__all__ = ["CollectivesProbe", "CollectivesConfig", "OPS", "synchronize", "device_clock"]

OPS = (
    "all_reduce_sum",
    "all_reduce_max",
    "all_reduce_min",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "send_recv_ring",
    "barrier",
)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int64": torch.int64}


@dataclass
class CollectivesConfig:
    """Options of the collectives probe, the `[probes.collectives]` table."""

    numel: int = 1024
    """Elements per tensor (per rank and chunk)."""
    dtypes: list[str] = field(default_factory=lambda: ["float32", "bfloat16", "int64"])
    """Element types to test: float32, bfloat16, int64."""
    ops: list[str] = field(default_factory=lambda: list(OPS))
    """Which checks to run (see distdiag.probes.cluster.collectives.OPS)."""
    subgroups: bool = True
    """Also check all_reduce on sub-groups (pairs, halves) when the world allows it."""

    def __post_init__(self) -> None:
        if isinstance(self.numel, bool) or not isinstance(self.numel, int) or not 1 <= self.numel <= 2**28:
            raise ConfigError(f"probes.collectives.numel must be an integer in [1, 2**28], got {self.numel!r}")
        bad = [d for d in self.dtypes if d not in _DTYPES]
        if bad or not self.dtypes:
            raise ConfigError(f"probes.collectives.dtypes must name some of {', '.join(_DTYPES)}, got {self.dtypes!r}")
        bad = [o for o in self.ops if o not in OPS]
        if bad or not self.ops:
            raise ConfigError(f"probes.collectives.ops: unknown op {bad[0] if bad else '(none)'!r}; known: {', '.join(OPS)}")
        if not isinstance(self.subgroups, bool):
            raise ConfigError(f"probes.collectives.subgroups must be true or false, got {self.subgroups!r}")


def _tolerance(dtype: torch.dtype, expected: torch.Tensor, world: int) -> torch.Tensor:
    if not dtype.is_floating_point:
        return torch.zeros_like(expected)
    eps = torch.finfo(dtype).eps
    # A reduction over W ranks in any order: error grows with log2(W) rounding steps.
    return expected.abs() * eps * (math.ceil(math.log2(max(world, 2))) + 1) + eps


def synchronize(device: torch.device) -> None:
    """Wait until the work queued on `device` is done: `torch.<type>.synchronize` for an
    accelerator (cuda, xpu, ...), nothing on the CPU (its collectives return when done)."""
    if device.type in ("cpu", "meta"):
        return
    sync = getattr(getattr(torch, device.type, None), "synchronize", None)
    if sync is not None:
        sync(device)


def device_clock(device: torch.device) -> float:
    """time.perf_counter() once `device` has finished what was queued on it. An NCCL collective
    returns when it is enqueued: a clock read right after it measures the launch, not the
    collective (what slowest_rank_time_s reported before issue 35)."""
    synchronize(device)
    return time.perf_counter()


class _Checker:
    """Compares outputs with expected values; records failures and timings."""

    def __init__(self, rank: int, world: int, device: torch.device | None = None) -> None:
        self.rank = rank
        self.world = world
        self.device = device if device is not None else torch.device("cpu")
        self.failures: list[dict[str, Any]] = []
        self.checks = 0
        self.timings: dict[str, float] = {}

    def check(self, op: str, dtype_name: str, group: str, got: torch.Tensor, expected: torch.Tensor) -> None:
        self.checks += 1
        got64 = got.detach().to(torch.float64).reshape(-1)
        exp64 = expected.to(torch.float64).reshape(-1)
        if got64.shape != exp64.shape:
            self.failures.append(
                {"op": op, "dtype": dtype_name, "group": group,
                 "detail": f"shape {list(got.shape)}, expected {list(expected.shape)}"}
            )
            return
        err = (got64 - exp64).abs()
        tol = _tolerance(got.dtype, exp64, self.world)
        bad = (err > tol) | ~torch.isfinite(got64)
        if bool(bad.any()):
            idx = int(bad.nonzero()[0, 0])
            self.failures.append(
                {
                    "op": op, "dtype": dtype_name, "group": group,
                    "max_abs_err": float(err[torch.isfinite(err)].max()) if torch.isfinite(err).any() else float("inf"),
                    "bad_elements": int(bad.sum()), "numel": int(got64.numel()),
                    "first_bad_index": idx, "got": float(got64[idx]), "expected": float(exp64[idx]),
                }
            )

    def start(self) -> float:
        """The clock before a timed collective (earlier work on the device done first)."""
        return device_clock(self.device)

    def timed(self, key: str, started: float) -> None:
        self.timings[key] = self.timings.get(key, 0.0) + (device_clock(self.device) - started)


def _idx(n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float64)


@dataclass
class _WorldOps:
    """The world-group checks of one dtype, each group of ops as one method."""

    comm: Comm
    rank: int
    world: int
    n: int
    checker: _Checker
    ops: set[str]
    dname: str
    dtype: torch.dtype
    device: torch.device
    i: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.i = _idx(self.n)

    def make(self, values: torch.Tensor) -> torch.Tensor:
        return values.to(self.dtype).to(self.device)

    def expect(self, values: torch.Tensor) -> torch.Tensor:
        """The expected value as this dtype can hold it (data movement is exact)."""
        return values.to(self.dtype).to(torch.float64)

    def reductions(self) -> None:
        """all_reduce (sum, max, min) and broadcast."""
        comm, checker, rank, world, i, dname, ops, make = (
            self.comm, self.checker, self.rank, self.world, self.i, self.dname, self.ops, self.make)
        if "all_reduce_sum" in ops:
            x = make((rank + 1) + i % 3)
            t = checker.start()
            comm.all_reduce(x, op=dist.ReduceOp.SUM)
            checker.timed("all_reduce", t)
            checker.check("all_reduce(sum)", dname, "world", x.cpu(), world * (world + 1) / 2 + world * (i % 3))
        alt = torch.where(i % 2 == 0, torch.full_like(i, rank), torch.full_like(i, world - 1 - rank)) + i % 5
        if "all_reduce_max" in ops:
            x = make(alt)
            comm.all_reduce(x, op=dist.ReduceOp.MAX)
            checker.check("all_reduce(max)", dname, "world", x.cpu(), (world - 1) + i % 5)
        if "all_reduce_min" in ops:
            x = make(alt)
            comm.all_reduce(x, op=dist.ReduceOp.MIN)
            checker.check("all_reduce(min)", dname, "world", x.cpu(), i % 5)
        if "broadcast" in ops:
            for src in sorted({0, world - 1}):
                x = make(7 + src + i % 11) if rank == src else make(torch.full_like(i, -1))
                comm.broadcast(x, src=src)
                checker.check(f"broadcast(src={src})", dname, "world", x.cpu(), self.expect(7 + src + i % 11))

    def gathers(self) -> None:
        """all_gather, all_gather_into_tensor and reduce_scatter_tensor."""
        comm, checker, rank, world, n, i, dname, ops, make, expect = (
            self.comm, self.checker, self.rank, self.world, self.n, self.i, self.dname, self.ops, self.make, self.expect)
        mine = rank * 10 + i % 7
        if "all_gather" in ops:
            outs = [make(torch.full_like(i, -1)) for _ in range(world)]
            t = checker.start()
            comm.all_gather(outs, make(mine))
            checker.timed("all_gather", t)
            for r, out in enumerate(outs):
                checker.check(f"all_gather(from rank {r})", dname, "world", out.cpu(), expect(r * 10 + i % 7))
        if "all_gather_into_tensor" in ops:
            out = make(torch.full((world * n,), -1.0, dtype=torch.float64))
            comm.all_gather_into_tensor(out, make(mine))
            expected = torch.cat([expect(r * 10 + i % 7) for r in range(world)])
            checker.check("all_gather_into_tensor", dname, "world", out.cpu(), expected)
        if "reduce_scatter_tensor" in ops:
            chunks = [(rank + 1) * (j + 1) + i % 3 for j in range(world)]
            out = make(torch.full_like(i, -1))
            t = checker.start()
            comm.reduce_scatter_tensor(out, make(torch.cat(chunks)))
            checker.timed("reduce_scatter_tensor", t)
            checker.check("reduce_scatter_tensor", dname, "world", out.cpu(), (rank + 1) * world * (world + 1) / 2 + world * (i % 3))

    def exchanges(self, barrier: bool) -> None:
        """all_to_all_single (uneven), the send/recv ring, and the timed barrier (first dtype only)."""
        comm, checker, rank, world, n, i, dname, ops, make, expect = (
            self.comm, self.checker, self.rank, self.world, self.n, self.i, self.dname, self.ops, self.make, self.expect)
        if "all_to_all_single" in ops:
            unit = max(1, n // (4 * world))
            send_sizes = [unit * (1 + (rank + 2 * j) % 3) for j in range(world)]
            recv_sizes = [unit * (1 + (j + 2 * rank) % 3) for j in range(world)]
            send = torch.cat([torch.full((send_sizes[j],), float(rank * 16 + j)) for j in range(world)])
            out = make(torch.full((sum(recv_sizes),), -1.0, dtype=torch.float64))
            comm.all_to_all_single(out, make(send), recv_sizes, send_sizes)
            expected = torch.cat([expect(torch.full((recv_sizes[j],), float(j * 16 + rank))) for j in range(world)])
            checker.check("all_to_all_single(uneven)", dname, "world", out.cpu(), expected)
        if "send_recv_ring" in ops:
            dst, src = (rank + 1) % world, (rank - 1) % world
            recv = make(torch.full_like(i, -1))
            comm.send_recv(make(rank * 3 + 1 + i % 5), dst, recv, src)
            checker.check(f"send_recv(ring {src}->{rank})", dname, "world", recv.cpu(), expect(src * 3 + 1 + i % 5))
        if "barrier" in ops and barrier:
            t = checker.start()
            comm.barrier()
            checker.timed("barrier", t)


class CollectivesProbe(Probe):
    name = "collectives"
    summary = "collectives that return wrong values (all_reduce, gathers, reduce_scatter, all_to_all, p2p) per rank, op and dtype"
    min_world_size = 2
    Config = CollectivesConfig

    def run(self, ctx: RankContext) -> dict[str, Any]:
        opts: CollectivesConfig = self.options(ctx)
        rank, world = ctx.rank, ctx.world_size
        device = ctx.device
        checker = _Checker(rank, world, device)
        for dtype_name in opts.dtypes:
            dtype = _DTYPES[dtype_name]
            self._world_ops(ctx, checker, opts, dtype_name, dtype, device)
        if opts.subgroups:
            self._subgroups(ctx, checker, opts, device)
        return {
            "failures": checker.failures,
            "checks": checker.checks,
            "timings_s": {k: round(v, 6) for k, v in checker.timings.items()},
        }

    def _world_ops(self, ctx: RankContext, checker: _Checker, opts: CollectivesConfig, dname: str, dtype: torch.dtype, device: torch.device) -> None:
        # Every rank runs the same collectives in the same order (gloo pairs them by order).
        world_ops = _WorldOps(ctx.comm, ctx.rank, ctx.world_size, opts.numel, checker, set(opts.ops), dname, dtype, device)
        world_ops.reductions()
        world_ops.gathers()
        world_ops.exchanges(barrier=dname == opts.dtypes[0])

    def _subgroups(self, ctx: RankContext, checker: _Checker, opts: CollectivesConfig, device: torch.device) -> None:
        rank, world = ctx.rank, ctx.world_size
        layouts: list[list[list[int]]] = []
        if world >= 4 and world % 2 == 0:
            layouts.append([[r, r + 1] for r in range(0, world, 2)])
            layouts.append([list(range(world // 2)), list(range(world // 2, world))])
        i = _idx(opts.numel)
        for layout in layouts:
            mine = None
            for ranks in layout:  # every rank creates every group, in the same order
                group = dist.new_group(ranks)
                if rank in ranks:
                    mine = (group, ranks)
            assert mine is not None
            group, ranks = mine
            label = group_name(group)
            x = ((rank + 1) + i % 3).to(torch.float32).to(device)
            ctx.comm.all_reduce(x, group=group)
            checker.check("all_reduce(sum)", "float32", label, x.cpu(), sum(r + 1 for r in ranks) + len(ranks) * (i % 3))

    def consolidate(self, payloads: dict[int, dict[str, Any]], view: ConsolidationView) -> ProbeResult:
        merged: dict[tuple[str, str, str], list[tuple[int, dict[str, Any]]]] = {}
        for rank, payload in sorted(payloads.items()):
            for fail in payload["failures"]:
                merged.setdefault((fail["op"], fail["dtype"], fail["group"]), []).append((rank, fail))
        findings = []
        for (op, dtype, group), items in merged.items():
            ranks = [r for r, _ in items]
            lines = []
            for r, fail in items:
                if "detail" in fail:
                    lines.append(f"rank {r}: {fail['detail']}")
                else:
                    lines.append(
                        f"rank {r}: {fail['bad_elements']}/{fail['numel']} elements wrong, "
                        f"max abs error {fail['max_abs_err']:g}; first at index {fail['first_bad_index']}: "
                        f"got {fail['got']:g}, expected {fail['expected']:g}"
                    )
            where = "" if group == "world" else f" on group {group}"
            from distdiag.report.render import format_ranks

            findings.append(
                Finding(
                    severity="error",
                    issue=f"{op} on {dtype}{where} returned wrong values on {format_ranks(ranks)}",
                    evidence="\n".join(lines),
                    ranks=ranks,
                    fix=(
                        "a collective that returns wrong data points at the transport or the hardware: "
                        "rerun with NCCL_DEBUG=INFO, check the NIC/NVLink of the named ranks' hosts, "
                        "and take them out if it repeats"
                    ),
                    confidence=0.9,
                )
            )
        checks = sum(p["checks"] for p in payloads.values())
        timings: dict[str, float] = {}
        for p in payloads.values():
            for k, v in p["timings_s"].items():
                timings[k] = max(timings.get(k, 0.0), v)
        metrics = {"checks": checks, "failures": sum(len(p["failures"]) for p in payloads.values()),
                   "slowest_rank_time_s": timings}
        return ProbeResult.from_findings(self.name, findings, metrics=metrics)
