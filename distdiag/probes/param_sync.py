"""`param_sync`: what must be identical on every rank, checksummed after setup and after each step.

Comparing the full tensors of a sharded parameter proves nothing (gathering makes them agree
by construction), so the probe checksums only what each rank holds as a replica: buffers,
parameters FSDP does not manage (plain tensors), and DTensor parameters with Replicate
placements, grouped by their coordinates on the sharded mesh dims (the replicas of one
shard under HSDP). The CPU (and CUDA) RNG states are checksummed too. Checksums are exact
(over the bits), so "equal" means bitwise equal, as replicas of one update must be.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from distdiag.errors import ConfigError
from distdiag.probes import _training as tr
from distdiag.probes._parity_report import setup_failure
from distdiag.probes._shared import parallel_run
from distdiag.probes.base import ConsolidationView, group_ranks, minority_ranks
from distdiag.render import format_ranks
from distdiag.report import Finding, ProbeResult

__all__ = ["ParamSyncProbe", "ParamSyncConfig", "bit_checksum", "replica_tensors", "snapshot"]

_INT_VIEW = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


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


def bit_checksum(t: torch.Tensor) -> str:
    """A checksum of a tensor's bits (equal bits -> equal checksum), without copying to numpy."""
    t = t.detach().cpu().contiguous().reshape(-1)
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    if t.is_complex():
        t = torch.view_as_real(t).reshape(-1)
    bits = t.view(_INT_VIEW[t.element_size()]).to(torch.int64)
    # Position-weighted sums (wrapping int64 arithmetic): a swap or a flipped bit changes them.
    weights = torch.arange(1, bits.numel() + 1, dtype=torch.int64) * 2654435761 % 2147483647
    return f"{int((bits * weights).sum()) & 0xFFFFFFFFFFFFFFFF:016x}-{int(bits.sum()) & 0xFFFFFFFF:08x}-{bits.numel()}"


def replica_tensors(model: nn.Module, world: int) -> dict[str, tuple[str, torch.Tensor]]:
    """key -> (kind, local tensor) for everything that must be equal on the ranks sharing the key.

    A DTensor's key is its FQN plus its coordinates on the mesh dims it is sharded on: ranks
    that differ only on Replicate dims (HSDP), or that sit in different copies of a mesh
    smaller than the world, hold replicas of the same shard. A key held by one rank only
    (plain FSDP sharding) is not compared.
    """
    from torch.distributed.tensor import DTensor, Replicate

    out: dict[str, tuple[str, torch.Tensor]] = {}
    for name, b in model.named_buffers():
        out[f"buffer {tr.canonical_name(name)}"] = ("buffer", b.to_local() if isinstance(b, DTensor) else b)
    for name, p in model.named_parameters():
        fqn = tr.canonical_name(name)
        if not isinstance(p, DTensor):
            out[f"param {fqn}"] = ("unmanaged param", p)
            continue
        mesh = p.device_mesh
        replicated = [d for d, pl in enumerate(p.placements) if isinstance(pl, Replicate)]
        coords = mesh.get_coordinate() or []
        names = mesh.mesh_dim_names or tuple(str(d) for d in range(mesh.ndim))
        where = ",".join(f"{names[d]}={c}" for d, c in enumerate(coords) if d not in replicated)
        if len(replicated) == len(p.placements):
            kind = "replicated param"
        elif replicated:
            kind = "HSDP shard replica"
        elif mesh.size() < world:
            kind = "sub-mesh shard replica"
        else:
            kind = "sharded param"
        out[f"param {fqn}" + (f" [shard {where}]" if where else "")] = (kind, p.to_local())
    return out


def _rng_states() -> dict[str, str]:
    states = {"cpu": bit_checksum(torch.get_rng_state())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = bit_checksum(torch.cuda.get_rng_state())
    return states


def snapshot(model: nn.Module, world: int) -> dict[str, Any]:
    """Checksums of what must be equal across ranks, and the RNG states (one entry of `snaps`)."""
    tensors = replica_tensors(model, world)
    return {
        "sums": {k: [kind, bit_checksum(t), float(t.detach().double().sum())] for k, (kind, t) in tensors.items()},
        "rng": _rng_states(),
    }


class ParamSyncProbe(tr.NumericsProbe):
    name = "param_sync"
    summary = "buffers, unmanaged or replicated parameters and RNG states that differ across ranks (replicas drifting)"
    Config = ParamSyncConfig

    def run(self, ctx: Any) -> dict[str, Any]:
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
        return {"source": source, "snaps": run.snaps[: opts.steps + 1]}

    def consolidate(self, payloads: dict[int, dict[str, Any]], view: ConsolidationView) -> ProbeResult:
        if (failed := setup_failure(self.name, payloads, "snaps")) is not None:
            return failed
        ranks = sorted(payloads)
        nsnaps = min(len(p["snaps"]) for p in payloads.values())
        findings: list[Finding] = []
        keys = sorted({k for p in payloads.values() for k in p["snaps"][0]["sums"]})
        compared = 0
        drifts: dict[tuple[str, int, tuple[int, ...]], list[tuple[str, dict[str, list[int]]]]] = {}
        for key in keys:
            holders = [r for r in ranks if key in payloads[r]["snaps"][0]["sums"]]
            if len(holders) < 2:
                continue
            compared += 1
            for i in range(nsnaps):
                groups = group_ranks(holders, lambda r, i=i, key=key: payloads[r]["snaps"][i]["sums"][key][1])
                if len(groups) > 1:
                    kind = payloads[holders[0]]["snaps"][0]["sums"][key][0]
                    drifts.setdefault((kind, i, tuple(minority_ranks(groups))), []).append((key, groups))
                    break
        # One finding per kind, first step and set of ranks: a module left out drifts as a whole.
        for (kind, i, _), items in drifts.items():
            findings.append(_drift_finding(kind, i, items, payloads))
        for which in ("cpu", "cuda"):
            for i in range(nsnaps):
                holders = [r for r in ranks if which in payloads[r]["snaps"][i]["rng"]]
                groups = group_ranks(holders, lambda r, i=i, which=which: payloads[r]["snaps"][i]["rng"][which])
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
                    ))
                    break
        findings.append(Finding(
            severity="info",
            issue=f"checked {compared} replicated tensor(s) of {payloads[ranks[0]]['source']} after setup and {nsnaps - 1} step(s)",
            evidence="buffers, parameters FSDP does not manage, Replicate DTensor parameters and HSDP shard replicas; bitwise",
        ))
        metrics = {"replicated_tensors": compared, "steps": nsnaps - 1, "drifting": sum(1 for f in findings if f.severity == "error")}
        return ProbeResult.from_findings(self.name, findings, metrics=metrics)


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
    if kind == "buffer":
        fix = "the buffer is computed differently per rank (rank-dependent init or an update not synchronised); initialise it identically, or broadcast it from rank 0 after build"
    elif kind == "unmanaged param":
        fix = "no FSDP group manages these parameters, so their gradients are never reduced and each rank steps with its own: include them in fully_shard (not in ignored_params), or all-reduce their gradients"
    else:
        fix = (
            "replicas of one shard diverged: gradients are not reduced across the replicas (for HSDP pass the "
            "2-D mesh to fully_shard, not its shard sub-mesh; do not leave set_requires_all_reduce(False) on)"
        )
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
    )
