"""`param_sync`: what must be identical on every rank, checksummed after setup and after each step.

Comparing the full tensors of a sharded parameter proves nothing (gathering makes them agree
by construction), so the probe checksums only what each rank holds as a replica: buffers,
parameters FSDP does not manage (plain tensors), and DTensor parameters with Replicate
placements, grouped by their coordinates on the sharded mesh dims (the replicas of one
shard under HSDP). The CPU (and CUDA) RNG states are checksummed too. Checksums are exact
(over the bits), so "equal" means bitwise equal, as replicas of one update must be.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING, Any

from distdiag.errors import ConfigError
from distdiag.probes import training as tr
from distdiag.probes.base import ConsolidationView, group_values, minority_ranks
from distdiag.probes.causes import ProbeCause
from distdiag.probes.numerics.parity_report import setup_failure
from distdiag.probes.numerics.setup_findings import FIXES
from distdiag.probes.numerics.shared import parallel_run
from distdiag.report.model import Finding, ProbeResult
from distdiag.report.render import format_ranks

if TYPE_CHECKING:
    from distdiag.runtime.context import RankContext

__all__ = ["ParamSyncProbe", "ParamSyncConfig"]


@dataclass
class ParamSyncConfig:
    """Options of the param_sync probe, the `[probes.param_sync]` table."""

    steps: int = 2
    """Training steps after setup; replicas are compared after setup and after each step."""
    workload: str = "transformer"
    """Built-in workload used without a target: mlp or transformer."""

    def __post_init__(self) -> None:
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or not 0 <= self.steps <= 100:
            raise ConfigError(f"probes.param_sync.steps must be an integer in [0, 100], got {self.steps!r}")
        tr.check_workload("probes.param_sync.workload", self.workload)


UNIQUE_KIND = "sharded param"
"""A shard of a parameter sharded over a mesh of the whole world with no Replicate dim (plain
FSDP): its key (FQN and mesh coordinates) is this rank's alone, so it is never compared."""


def comparable(snap: dict[str, Any]) -> dict[str, Any]:
    """A snapshot (distdiag.probes.numerics.replicas.snapshot, shared with determinism, left as
    it is) without the sums of shards no other rank holds: under FSDP they are most of what a
    rank would post (9 KB of ~17 KB at 16k ranks with the built-in workload: issue 21), and
    their keys are unique, so the consolidation (tensors held by more than one rank) is the same."""
    return {**snap, "sums": {k: v for k, v in snap["sums"].items() if v[0] != UNIQUE_KIND}}


class ParamSyncProbe(tr.NumericsProbe):
    name = "param_sync"
    summary = "buffers, unmanaged or replicated parameters and RNG states that differ across ranks (replicas drifting)"
    Config = ParamSyncConfig

    def run(self, ctx: RankContext) -> dict[str, Any]:
        opts: ParamSyncConfig = self.options(ctx)
        run = parallel_run(ctx, opts.workload)  # built, checksummed after setup, and trained once for all probes
        source = run.hooks.source
        if run.failed:
            return {"setup_error": run.error, "source": source}
        error = None
        try:
            run.ensure_optimizer()
            shards = {s: run.shard(ctx, s) for s in range(len(run.steps) + 1, opts.steps + 1)}
        except tr.HookError as exc:
            error = str(exc)
        if tr.agree(ctx, error is not None):
            return {"setup_error": error, "source": source}
        try:
            run.advance(ctx, opts.steps, shards)
        except tr.HookError as exc:
            return {"setup_error": f"step {run.failed_step}: {exc}", "source": source}
        return {"source": source, "snaps": [comparable(snap) for snap in run.snaps[: opts.steps + 1]]}

    def consolidate(self, payloads: dict[int, dict[str, Any]], view: ConsolidationView) -> ProbeResult:
        if (failed := setup_failure(self.name, payloads, "snaps")) is not None:
            return failed
        ranks = sorted(payloads)
        nsnaps = min(len(p["snaps"]) for p in payloads.values())
        findings: list[Finding] = []
        compared = 0
        drifts: dict[tuple[str, int, tuple[int, ...]], list[tuple[str, dict[str, list[int]]]]] = {}
        # Each snapshot's sums of every rank, looked up once, not per tensor (16k ranks, issue 21).
        snaps = [payloads[r]["snaps"] for r in ranks]
        sums = [[s[i]["sums"] for s in snaps] for i in range(nsnaps)]
        rngs = [[s[i]["rng"] for s in snaps] for i in range(nsnaps)]
        holding = _replicated(sums[0])
        for key in sorted(holding):
            at = holding[key]
            holders = [ranks[j] for j in at]
            compared += 1
            for i in range(nsnaps):
                per_rank = sums[i]
                groups = group_values(holders, [per_rank[j][key][1] for j in at])
                if len(groups) > 1:
                    kind = payloads[holders[0]]["snaps"][0]["sums"][key][0]
                    drifts.setdefault((kind, i, tuple(minority_ranks(groups))), []).append((key, groups))
                    break
        # One finding per kind, first step and set of ranks: a module left out drifts as a whole.
        for (kind, i, _), items in drifts.items():
            findings.append(_drift_finding(kind, i, items, payloads))
        for which in ("cpu", "cuda"):
            for i in range(nsnaps):
                held = [(r, s[which]) for r, s in zip(ranks, rngs[i], strict=True) if which in s]
                groups = group_values([r for r, _ in held], [v for _, v in held])
                if len(groups) > 1:
                    odd = minority_ranks(groups)
                    findings.append(Finding(
                        severity="warning",
                        issue=f"the {which.upper()} RNG state differs across ranks {_when(i)}: {format_ranks(odd)} out of step with the others",
                        evidence="; ".join(f"{format_ranks(g)}: state {h[:16]}" for h, g in groups.items()),
                        ranks=odd,
                        fix=(
                            "a rank drew a different amount of random numbers (rank-dependent code in build_model, "
                            "parallelize or the step); anything that needs equal randomness across ranks (tensor-parallel "
                            "dropout, weight init) then differs: seed after rank-dependent code, or use a dedicated generator"
                        ),
                        confidence=0.8,
                        cause=ProbeCause.RNG_OUT_OF_STEP,
                    ))
                    break
        findings.append(Finding(
            severity="info",
            issue=f"checked {compared} replicated tensor(s) of {payloads[ranks[0]]['source']} after setup and {nsnaps - 1} step(s)",
            evidence="buffers, parameters FSDP does not manage, Replicate DTensor parameters and HSDP shard replicas; bitwise",
        ))
        metrics = {"replicated_tensors": compared, "steps": nsnaps - 1, "drifting": sum(1 for f in findings if f.severity == "error")}
        return ProbeResult.from_findings(self.name, findings, metrics=metrics)


def _replicated(first: list[dict[str, Any]]) -> dict[str, list[int]]:
    """Each tensor more than one rank holds -> the indices (into `first`, every rank's sums of
    the first snapshot, in rank order) of the ranks holding it: counted in one pass, then one
    pass over every rank's keys (asking every rank about every key was keys x ranks, and a
    sharded model has a key per shard: N^2 at 16k ranks)."""
    counts = Counter(chain.from_iterable(first))
    multi = {k for k, n in counts.items() if n > 1}
    holding: dict[str, list[int]] = {}
    for j, held in enumerate(first):
        for key in held:
            if key in multi:
                holding.setdefault(key, []).append(j)
    return holding


def _when(i: int) -> str:
    return "right after setup" if i == 0 else f"after step {i}"


def _drift_finding(kind: str, i: int, items: list[tuple[str, dict[str, list[int]]]], payloads: dict[int, dict[str, Any]]) -> Finding:
    key, groups = items[0]
    odd = minority_ranks(groups)
    names = [k.split(" ", 1)[1] for k, _ in items]
    lines = []
    for k, grp in items[:6]:
        sums = ", ".join(
            f"{format_ranks(members)}: sum {payloads[members[0]]['snaps'][i]['sums'][k][2]:.9g}"
            for _, members in sorted(grp.items(), key=lambda kv: -len(kv[1]))
        )
        lines.append(f"{k.split(' ', 1)[1]}: {sums}")
    cause, fix = _cause_and_fix(kind, i)
    first = "already at setup" if i == 0 else f"first after step {i}"
    shown = ", ".join(names[:6]) + (f" (+{len(names) - 6} more)" if len(names) > 6 else "")
    plural = "s" if len(names) > 1 else ""
    return Finding(
        severity="error",
        issue=f"{kind}{plural} {shown} differ{'' if plural else 's'} across ranks ({first}): {format_ranks(odd)} disagree",
        evidence="\n".join(lines),
        ranks=odd,
        fix=fix,
        confidence=0.95,
        cause=cause,
    )


def _cause_and_fix(kind: str, i: int) -> tuple[ProbeCause, str]:
    """The mechanism of a drift: present right after setup (built or parallelized differently per
    rank), or appearing after a step (an update that is not the same on every rank)."""
    if i == 0 and kind in ("HSDP shard replica", "sub-mesh shard replica", "replicated param"):
        return ProbeCause.SETUP_DIVERGENCE_REPLICAS_DIFFER, (
            "the copies of these shards differ before the first step: a sharded checkpoint read (or an init run) on "
            "some replica groups only after fully_shard; every rank must read its own shard (DCP's load does), or "
            "broadcast each shard from the first replica over the replicate mesh dim"
        )
    if i == 0:
        cause = ProbeCause.SETUP_DIVERGENCE_BUFFER_PER_RANK if kind == "buffer" else ProbeCause.SETUP_DIVERGENCE
        return cause, FIXES[cause] + " (setup_sync compares the model as built, before parallelize, and names the mechanism)"
    if kind == "buffer":
        return ProbeCause.BUFFER_NOT_SYNCHRONISED, (
            "the buffer is updated differently per rank (running statistics of each rank's own batch, or an update "
            "not synchronised); use SyncBatchNorm or broadcast it from rank 0 where every rank must hold the same value"
        )
    if kind == "frozen param":
        return ProbeCause.UPDATED_OUTSIDE_OPTIMIZER_PER_RANK, (
            "these parameters take no gradient (requires_grad=False): no optimizer step and no gradient reduction "
            "moved them, so code outside the optimizer changed them, differently per rank - an EMA or teacher update "
            "run on some ranks only (or from per-rank values), a copy or a load on some ranks. Run that update on "
            "every rank from the same values, or broadcast these parameters from rank 0 after it"
        )
    if kind == "unmanaged param":
        return ProbeCause.UNMANAGED_PARAMS_NOT_REDUCED, (
            "no FSDP group (or DistributedDataParallel reducer) manages these parameters, so their gradients are never "
            "reduced and each rank steps with its own: include them in fully_shard (not in ignored_params); under "
            "DistributedDataParallel, make them trainable before the wrap; or all-reduce their gradients"
        )
    return ProbeCause.REPLICAS_NOT_REDUCED, (
        "replicas of one shard diverged: gradients are not reduced across the replicas (for HSDP pass the "
        "2-D mesh to fully_shard, not its shard sub-mesh; do not leave set_requires_all_reduce(False) on)"
    )
