"""`fsdp_plan`: an audit of how `parallelize` sharded every parameter, and what it left out.

Each rank builds the model, applies parallelize, and describes every parameter: its FSDP
group (the module fully_shard was applied to), mesh, placements, local shard size, dtype,
the group's mixed-precision policy and reshard setting, and which parameters are tied.
Consolidation puts the table into the report (`details["table:fsdp plan"]`) and raises
findings for what silently breaks training: trainable parameters no group manages (their
gradients are never reduced), a parameter managed twice, ties broken by sharding, memory
unbalanced across ranks, and gradients reduced in a lower precision than the parameters.
No collectives are issued besides the setup agreement.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypedDict

from torch import nn

from distdiag.errors import ConfigError
from distdiag.probes import training as tr
from distdiag.probes.base import ConsolidationView
from distdiag.probes.causes import ProbeCause
from distdiag.probes.numerics.parity_report import setup_failure
from distdiag.probes.numerics.shared import parallel_run
from distdiag.report.model import Finding, ProbeResult
from distdiag.report.render import format_ranks

if TYPE_CHECKING:
    from distdiag.runtime.context import RankContext

__all__ = ["FsdpPlanProbe", "FsdpPlanConfig", "describe_plan"]


@dataclass
class FsdpPlanConfig:
    """Options of the fsdp_plan probe, the `[probes.fsdp_plan]` table."""

    workload: str = "transformer"
    """Built-in workload used without a target: mlp or transformer."""
    imbalance_warn: float = 1.25
    """Warn when the largest rank's parameter bytes exceed the smallest's by this factor."""

    def __post_init__(self) -> None:
        tr.check_workload("probes.fsdp_plan.workload", self.workload)
        if not isinstance(self.imbalance_warn, (int, float)) or not self.imbalance_warn >= 1.0:
            raise ConfigError(f"probes.fsdp_plan.imbalance_warn must be a number >= 1.0, got {self.imbalance_warn!r}")


def _dtype(d: object) -> str | None:
    return str(d).replace("torch.", "") if d is not None else None


class FsdpGroup(TypedDict):
    """An FSDP parameter group as the plan shows it: the module it is on, its mixed-precision
    dtypes, and whether (or to how many ranks) it reshards after forward."""

    group: str
    param_dtype: str | None
    reduce_dtype: str | None
    reshard: bool | str


class PlanRow(TypedDict, total=False):
    """One parameter name on one rank: its shape and dtype, the FSDP groups managing it, its
    DTensor layout (or a plain tensor's), and the first group's dtypes and resharding."""

    fqn: str
    shape: list[int]
    dtype: str
    requires_grad: bool
    groups: list[str]
    tied: list[str]
    ddp: bool
    mesh: str
    placements: str
    local_numel: int
    mesh_size: int
    replicate: bool
    local_bytes: int
    param_dtype: str | None
    reduce_dtype: str | None
    reshard: bool | str


def _groups(model: nn.Module) -> dict[int, list[FsdpGroup]]:
    """id(parameter) -> the FSDP groups managing it (FSDP2 internals, read defensively)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    fqn = {id(m): n or "(root)" for n, m in model.named_modules()}
    out: dict[int, list[FsdpGroup]] = {}
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        state = fully_shard.state(module)  # type: ignore[attr-defined]
        for group in getattr(state, "_fsdp_param_groups", []) or []:
            mp = group.mp_policy
            post = group.post_forward_mesh_info
            if post is None:
                reshard: bool | str = False
            elif post.mesh is group.mesh_info.mesh or post.mesh == group.mesh_info.mesh:
                reshard = True
            else:
                reshard = f"to {post.mesh.size()} ranks"
            info: FsdpGroup = {
                "group": fqn.get(id(module), type(module).__name__),
                "param_dtype": _dtype(mp.param_dtype),
                "reduce_dtype": _dtype(mp.reduce_dtype),
                "reshard": reshard,
            }
            for fp in group.fsdp_params:
                out.setdefault(id(fp.sharded_param), []).append(info)
    return out


def describe_plan(model: nn.Module, world: int) -> list[PlanRow]:
    """One row per parameter name (tied names each get a row), on this rank."""
    from torch.distributed.tensor import DTensor

    groups = _groups(model)
    is_ddp = isinstance(model, nn.parallel.DistributedDataParallel)
    names_of: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(tr.canonical_name(name))
    rows: list[PlanRow] = []
    for name, p in model.named_parameters(remove_duplicate=False):
        cname = tr.canonical_name(name)
        managing = groups.get(id(p), [])
        row: PlanRow = {
            "fqn": cname,
            "shape": list(p.shape),
            "dtype": str(p.dtype).replace("torch.", ""),
            "requires_grad": bool(p.requires_grad),
            "groups": [g["group"] for g in managing],
            "tied": [n for n in names_of[id(p)] if n != cname],
            "ddp": is_ddp,
        }
        if isinstance(p, DTensor):
            local = p.to_local()
            mesh = p.device_mesh
            row["mesh"] = f"{tuple(mesh.shape)}" + (f" {mesh.mesh_dim_names}" if mesh.mesh_dim_names else "")
            row["placements"] = ", ".join(str(x) for x in p.placements)
            row["local_numel"] = int(local.numel())
            row["mesh_size"] = int(mesh.size())
            row["replicate"] = any(type(x).__name__ == "Replicate" for x in p.placements)
            row["local_bytes"] = int(local.numel() * local.element_size())
        else:
            row["mesh"], row["placements"] = "-", "(plain tensor)"
            row["local_numel"], row["local_bytes"] = int(p.numel()), int(p.numel() * p.element_size())
        if managing:
            first = managing[0]
            row["param_dtype"], row["reduce_dtype"], row["reshard"] = first["param_dtype"], first["reduce_dtype"], first["reshard"]
        rows.append(row)
    return rows


class FsdpPlanProbe(tr.NumericsProbe):
    name = "fsdp_plan"
    summary = "parameters FSDP does not manage (never reduced), managed twice, ties broken, memory unbalanced, low-precision reduction"
    Config = FsdpPlanConfig
    shared_fields = ("rows",)
    """Stored once for all ranks (issue 21): the sharding plan's rows: the same on every rank but the last of an uneven split."""

    def run(self, ctx: RankContext) -> dict[str, Any]:
        opts: FsdpPlanConfig = self.options(ctx)
        run = parallel_run(ctx, opts.workload)  # the model the other numerics probes train (built once)
        if run.failed:
            return {"setup_error": run.error, "source": run.hooks.source}
        return {"source": run.hooks.source, "rows": describe_plan(run.model, ctx.world_size), "ties": run.ties}

    def consolidate(self, payloads: dict[int, dict[str, Any]], view: ConsolidationView) -> ProbeResult:
        if (failed := setup_failure(self.name, payloads, "rows")) is not None:
            return failed
        ranks = sorted(payloads)
        opts: FsdpPlanConfig = self.options(view)
        base = payloads[ranks[0]]["rows"]
        table = [_table_row(row, [payloads[r]["rows"][i]["local_numel"] for r in ranks if i < len(payloads[r]["rows"])])
                 for i, row in enumerate(base)]
        problems = _RowProblems.scan(base, view.world_size)
        findings = problems.findings(base, ranks, view.world_size, payloads[ranks[0]]["ties"])
        per_rank = {r: sum(x["local_bytes"] for x in payloads[r]["rows"]) for r in ranks}
        findings.extend(_imbalance(per_rank, opts.imbalance_warn))
        findings.append(Finding(severity="info", issue=f"audited {len(base)} parameter(s) of {payloads[ranks[0]]['source']}",
                                evidence=", ".join(f"rank {r}: {b} B of local parameters" for r, b in per_rank.items())))
        metrics = {"params": len(base), "unmanaged": len(problems.unmanaged), "local_param_bytes": {str(r): b for r, b in per_rank.items()}}
        return ProbeResult.from_findings(self.name, findings, metrics=metrics, details={"table:fsdp plan": table})


def _table_row(row: PlanRow, sizes: list[int]) -> dict[str, str]:
    """One parameter's row of the plan table; `sizes` are its local numels, rank by rank."""
    uneven = len(set(sizes)) > 1
    shown = f"{sizes[0]} each" if not uneven else ",".join(map(str, sizes))
    return {
        "fqn": row["fqn"], "group": ",".join(row["groups"]) or ("DDP" if row["ddp"] else "-"),
        "mesh": row["mesh"], "placements": row["placements"], "shape": "x".join(map(str, row["shape"])) or "scalar",
        "local numel/rank": shown, "uneven": "yes" if uneven else "", "dtype": row["dtype"],
        "param/reduce dtype": f"{row.get('param_dtype') or '-'}/{row.get('reduce_dtype') or '-'}",
        "reshard": str(row.get("reshard", "-")), "tied with": ",".join(row["tied"]),
    }


@dataclass
class _RowProblems:
    """The parameters of rank 0's plan that are left out, partly reduced, managed twice or reduced in low precision."""

    unmanaged: list[str]
    partial: list[str]
    twice: list[str]
    low_precision: list[str]

    @classmethod
    def scan(cls, base: list[PlanRow], world: int) -> _RowProblems:
        out = cls([], [], [], [])
        for row in base:
            if row["requires_grad"] and not row["groups"] and not row["ddp"] and world > 1:
                out.unmanaged.append(row["fqn"])
            if row.get("mesh_size", world) < world and not row.get("replicate") and row["requires_grad"]:
                out.partial.append(row["fqn"])
            if len(row["groups"]) > 1:
                out.twice.append(f"{row['fqn']} (groups {', '.join(row['groups'])})")
            low = _lower_precision(row)
            if low:
                out.low_precision.append(f"{row['fqn']}: {low}")
        return out

    def findings(self, base: list[PlanRow], ranks: list[int], world: int, ties: list[list[str]]) -> list[Finding]:
        """A finding per kind of problem found, with the broken ties between managed-twice and low precision."""
        unmanaged, partial, twice, low_precision = self.unmanaged, self.partial, self.twice, self.low_precision
        findings = []
        if unmanaged:
            modules = _outermost(unmanaged, [r["fqn"] for r in base])
            findings.append(Finding(
                severity="error",
                issue=f"{len(unmanaged)} trainable parameter(s) are not managed by any FSDP group, in module(s) {', '.join(modules[:6])}: their gradients are never reduced and replicas drift",
                evidence="unmanaged: " + ", ".join(unmanaged[:12]) + (f" (+{len(unmanaged) - 12} more)" if len(unmanaged) > 12 else ""),
                ranks=ranks,
                fix="apply fully_shard to the module left out, or to the root module so that it takes every remaining parameter",
            ))
        if partial:
            size = next(r["mesh_size"] for r in base if r["fqn"] == partial[0])
            # A warning, not an error: pipeline stages legitimately own the other ranks.
            findings.append(Finding(
                severity="warning",
                issue=(
                    f"{len(partial)} parameter(s) are sharded on a mesh of {size} of the {world} ranks with no "
                    f"replicate dim: nothing reduces their gradients across the {world // max(size, 1)} copies"
                ),
                evidence="e.g. " + ", ".join(partial[:8]),
                ranks=ranks,
                fix=(
                    "for HSDP pass the 2-D (replicate, shard) mesh to fully_shard, not its shard sub-mesh; "
                    "fine if the other ranks are other pipeline stages (param_sync tells whether copies drift)"
                ),
            ))
        if twice:
            findings.append(Finding(severity="error", issue=f"{len(twice)} parameter(s) are managed by more than one FSDP group",
                                    evidence="; ".join(twice[:8]), ranks=ranks,
                                    fix="apply fully_shard once per parameter: to disjoint modules, parents after children"))
        findings.extend(_broken_ties(ties, base, ranks))
        if low_precision:
            findings.append(Finding(
                severity="warning",
                issue=f"{len(low_precision)} parameter(s) have gradients reduced in a lower precision than the parameters",
                evidence="; ".join(low_precision[:6]),
                ranks=ranks,
                fix="set MixedPrecisionPolicy(reduce_dtype=torch.float32) unless the lower-precision reduction is intended",
                confidence=0.7,
            ))
        return findings


def _imbalance(per_rank: dict[int, int], imbalance_warn: float) -> list[Finding]:
    """A warning when the heaviest rank holds over imbalance_warn times the lightest one's parameter bytes."""
    low_b, high_b = min(per_rank.values()), max(per_rank.values())
    if not (low_b > 0 and high_b / low_b > imbalance_warn):
        return []
    heavy = [r for r, b in per_rank.items() if b == high_b]
    return [Finding(
        severity="warning",
        issue=f"parameter memory is unbalanced across ranks: {high_b} bytes on {format_ranks(heavy)} vs {low_b} at least ({high_b / low_b:.2f}x)",
        evidence=", ".join(f"rank {r}: {b} B" for r, b in per_rank.items()),
        ranks=heavy,
        fix="shard the large parameters (dim 0 divisible by the world size), or put large unsharded ones under fully_shard",
    )]


def _outermost(names: list[str], every: list[str]) -> list[str]:
    """The outermost modules whose parameters are all in `names` (the block left out, not its leaves)."""
    chosen = set(names)
    out: set[str] = set()
    for name in names:
        parts = name.split(".")
        best = ".".join(parts[:-1]) or "(root)"
        for depth in range(len(parts) - 1, 0, -1):
            prefix = ".".join(parts[:depth])
            if all(n in chosen for n in every if n.startswith(prefix + ".")):
                best = prefix
        out.add(best)
    return sorted(out)


_BITS = {"float64": 64, "float32": 32, "bfloat16": 16, "float16": 16}


def _lower_precision(row: PlanRow) -> str | None:
    reduce = row.get("reduce_dtype") or row.get("param_dtype")
    if not row["requires_grad"] or not reduce or reduce not in _BITS or row["dtype"] not in _BITS:
        return None
    if _BITS[reduce] < _BITS[row["dtype"]]:
        return f"reduced in {reduce}, stored in {row['dtype']}"
    return None


def _broken_ties(ties: list[list[str]], rows: list[PlanRow], ranks: list[int]) -> list[Finding]:
    tied_after = {r["fqn"]: set(r["tied"]) for r in rows}
    broken = [names for names in ties if any(set(names) - {n} - tied_after.get(n, set()) for n in names)]
    if not broken:
        return []
    first = {r["fqn"]: next(iter(r.get("groups") or []), None) for r in rows}
    # sharded apart (each user in an FSDP group of its own) or not: then the tie broke before
    # sharding, where fresh storage was made (to_empty after a meta-device init, a load with
    # assign=True, a module copied or rebuilt)
    apart = [b for b in broken if len({first.get(n) for n in b}) > 1]
    where = ("; ".join(f"{n} in {first.get(n) or 'no FSDP group'}" for n in apart[0]) if apart else
             "every name of each group is in the same FSDP group (" + ", ".join(sorted({str(first.get(n)) for b in broken for n in b})[:3]) + ")")
    fix = ("apply fully_shard to a module that contains every user of the tied weight (or the root), not to each user "
           "separately" if apart else
           "sharding did not split the tie: it broke before, where parallelize made fresh storage for one of the names "
           "(to_empty() after a meta-device init makes one tensor per name; so do load_state_dict(assign=True), a deepcopy "
           "or a rebuilt module): tie them again right after that step, before loading and fully_shard "
           "(model.head.weight = model.embed.weight, or the model's tie_weights())")
    return [Finding(
        severity="error",
        issue=f"{len(broken)} tied parameter group(s) are no longer shared after parallelize: " + "; ".join(" = ".join(b) for b in broken[:4]),
        evidence=f"the names share one Parameter in build_model's model, but are different tensors in the parallel model; {where}",
        ranks=ranks,
        fix=fix,
        confidence=0.9 if apart else 0.8,
        cause=ProbeCause.TIE_SHARDED_APART if apart else ProbeCause.TIE_BROKEN_BEFORE_SHARDING,
    )]

