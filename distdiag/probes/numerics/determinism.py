"""`determinism`: the same step twice gives the same bits, and every rank computes the same bits.

Two checks on each rank, one comparison across ranks:
- repeat, reference: forward + backward of loss_fn on the unsharded model and the global
  batch, twice, with the RNG state restored: the loss and every gradient must be bitwise equal;
- repeat, parallel: one full parallel step (train_step or loss_fn + backward + optimizer
  step, with its collectives) twice from the same state (parameters, buffers, optimizer
  state and RNG restored): bitwise equal loss and gradients;
- across ranks: the reference computation is the same on every rank (same model, same
  batch, same seed), so its bits must agree; a rank in the minority is named as a
  silent-data-corruption suspect (ranks on different hardware or software may differ
  legitimately: the env probe shows that).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from distdiag.errors import ConfigError
from distdiag.probes import training as tr
from distdiag.probes.base import ConsolidationView, alike, group_alike, group_values, minority_ranks
from distdiag.probes.numerics.parity_report import setup_failure
from distdiag.probes.numerics.replicas import bit_checksum
from distdiag.probes.numerics.shared import Fingerprint, fingerprint, parallel_run, release
from distdiag.report.model import Finding, ProbeResult
from distdiag.report.render import format_ranks

if TYPE_CHECKING:
    from distdiag.runtime.context import RankContext

__all__ = ["DeterminismProbe", "DeterminismConfig"]

_SEED = 4242


@dataclass
class DeterminismConfig:
    """Options of the determinism probe, the `[probes.determinism]` table."""

    workload: str = "transformer"
    """Built-in workload used without a target: mlp or transformer."""
    parallel: bool = True
    """Also repeat one full parallel step (with its collectives), not only the local reference."""

    def __post_init__(self) -> None:
        tr.check_workload("probes.determinism.workload", self.workload)
        if not isinstance(self.parallel, bool):
            raise ConfigError(f"probes.determinism.parallel must be true or false, got {self.parallel!r}")


def _ref_key(fp: Fingerprint) -> str:
    """A reference pass's fingerprint as one comparable string (loss and every gradient)."""
    return fp["loss"] + "|" + "|".join(f"{n}:{c}" for n, c in sorted(fp["grads"].items()))


def _diff(a: Fingerprint, b: Fingerprint) -> list[str]:
    out = ["loss"] if a["loss"] != b["loss"] else []
    return out + [n for n in a["grads"] if a["grads"][n] != b["grads"].get(n)]


def _ref_pass(ctx: RankContext, hooks: tr.Hooks, model: nn.Module, shard: Any) -> Fingerprint:
    model.zero_grad(set_to_none=True)
    ctx.seed(_SEED)
    loss = tr.call_loss(hooks, model, shard)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
        raise tr.HookError("hook loss_fn must return a scalar tensor that requires grad")
    loss.backward()
    grads = {tr.canonical_name(n): p.grad for n, p in model.named_parameters() if p.grad is not None}
    return fingerprint(float(loss.detach()), grads)




def _inputs_fingerprint(model: nn.Module, batch: Any) -> str:
    """The bits of the model as built and of the global batch: equal inputs, equal outputs."""
    parts = [bit_checksum(t) for t in list(model.parameters()) + list(model.buffers())]
    values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (tuple, list)) else [batch]
    parts += [bit_checksum(v) for v in values if isinstance(v, torch.Tensor)]
    return bit_checksum(torch.tensor([int(p.split("-")[0], 16) - (1 << 63) for p in parts], dtype=torch.int64))


class DeterminismProbe(tr.NumericsProbe):
    name = "determinism"
    summary = "a step that is not bitwise reproducible, or a rank whose identical computation gives different bits (SDC suspect)"
    Config = DeterminismConfig
    shared_fields = ("ref",)
    """The reference step's fingerprint: the same on every rank unless one computes other bits
    (the bug it reports), 1.5 KB a rank for the built-in workload."""

    def run(self, ctx: RankContext) -> dict[str, Any]:
        opts: DeterminismConfig = self.options(ctx)
        # The parallel model the other numerics probes built and trained: its step 1 (if one
        # of them ran it) is the first run of the step, so the repeat costs one step.
        run = parallel_run(ctx, opts.workload) if opts.parallel else None
        hooks = run.hooks if run is not None else tr.resolve_hooks(ctx, opts.workload)
        if run is not None and run.failed:
            release(ctx, run)
            return {"setup_error": run.error, "source": hooks.source}
        error = None
        try:
            ref = hooks.model(ctx.seed)
            batch = hooks.batch(1)
            inputs = _inputs_fingerprint(ref, batch)
            ref_shard = hooks.shard(batch, 0, 1)
            par_shard = hooks.shard(batch, ctx.rank, ctx.world_size)
            first = _ref_pass(ctx, hooks, ref, ref_shard)
            second = _ref_pass(ctx, hooks, ref, ref_shard)
            if run is not None:
                run.ensure_optimizer()
        except tr.HookError as exc:
            error = str(exc)
        if tr.agree(ctx, error is not None):
            if run is not None:
                release(ctx, run)
            return {"setup_error": error, "source": hooks.source}
        del ref
        out: dict[str, Any] = {"source": hooks.source, "ref": first, "ref_diff": _diff(first, second), "inputs": inputs}
        if run is not None:
            # Step 1 from the setup state, twice, with the same seed: bitwise equal loss and grads.
            try:
                if not run.steps:
                    run.rewind()
                    run.step(ctx, 1, par_shard)
                a = run.steps[0]
                run.rewind()
                run.step(ctx, 1, par_shard)
                b = run.steps[0]
            except tr.HookError as exc:
                return {"setup_error": f"parallel step: {exc}", "source": hooks.source}
            finally:
                release(ctx, run)  # the last probe that uses it in the suite's order
            out["par_diff"] = _diff(a.fingerprint, b.fingerprint)
            out["par_losses"] = [a.loss, b.loss]
        return out

    def consolidate(self, payloads: dict[int, dict[str, Any]], view: ConsolidationView) -> ProbeResult:
        if (failed := setup_failure(self.name, payloads, "ref")) is not None:
            return failed
        ranks = sorted(payloads)
        unstable = {r: p["ref_diff"] for r, p in payloads.items() if p["ref_diff"]}
        par_unstable = {r: p["par_diff"] for r, p in payloads.items() if p.get("par_diff")}
        findings = _repeat_findings(payloads, unstable, par_unstable)
        inputs = group_values(ranks, [payloads[r].get("inputs", "") for r in ranks])
        if len(inputs) > 1:
            findings.append(_inputs_finding(inputs))
        stable = [r for r in ranks if r not in unstable and len(inputs) == 1]
        # Each distinct reference fingerprint keyed once (ranks that posted it alike hold one object).
        groups = group_alike([(_ref_key(ref), rs) for ref, rs in alike(stable, [payloads[r]["ref"] for r in stable])])
        if len(groups) > 1:
            findings.append(_cross_rank_finding(payloads, view, stable, groups))
        elif unstable and not stable:
            findings.append(Finding(severity="info", issue="cross-rank bit comparison skipped: the reference step is not reproducible on any rank"))
        findings.append(Finding(
            severity="info",
            issue=f"repeated one step of {payloads[ranks[0]]['source']} bitwise on {len(ranks)} rank(s) and compared the ranks' bits",
            evidence=f"reference reproducible on {len(stable)}/{len(ranks)} rank(s); parallel step checked: {'par_diff' in payloads[ranks[0]]}",
        ))
        metrics = {"nondeterministic_ranks": sorted(set(unstable) | set(par_unstable)), "bit_groups": len(groups)}
        return ProbeResult.from_findings(self.name, findings, metrics=metrics)


def _repeat_findings(
    payloads: dict[int, dict[str, Any]], unstable: dict[int, list[str]], par_unstable: dict[int, list[str]]
) -> list[Finding]:
    """An error for each step (reference, parallel) that some rank could not repeat bitwise."""
    findings: list[Finding] = []
    for label, bad in (("the reference forward/backward", unstable), ("the parallel step", par_unstable)):
        if not bad:
            continue
        names = sorted({n for d in bad.values() for n in d})
        lines = [f"rank {r}: differs in {', '.join(d[:6])}" + (f" (+{len(d) - 6})" if len(d) > 6 else "") for r, d in sorted(bad.items())]
        if label == "the parallel step":
            lines += [f"rank {r}: losses {payloads[r]['par_losses'][0]!r} then {payloads[r]['par_losses'][1]!r}" for r in sorted(bad)]
        findings.append(Finding(
            severity="error",
            issue=f"{label} is not reproducible on {format_ranks(sorted(bad))}: run twice from the same state and RNG, {len(names)} of loss/gradients differ bitwise",
            evidence="\n".join(lines),
            ranks=sorted(bad),
            fix=(
                "a nondeterministic op or an unseeded random source is in the step: run it under "
                "torch.use_deterministic_algorithms(True) to have torch name the op (atomic scatter/index_add on GPU, "
                "nondeterministic cuDNN/cuBLAS kernels), and draw randomness from torch's seeded generators; "
                "for the parallel step only, also check that train_step keeps no state of its own that the repeat "
                "cannot restore (a step counter or schedule outside the model and optimizer)"
            ),
            confidence=0.9,
        ))
    return findings


def _inputs_finding(inputs: dict[str, list[int]]) -> Finding:
    """The ranks whose model and batch differ from the others' before any step."""
    odd = minority_ranks(inputs)
    return Finding(
        severity="error",
        issue=f"build_model or make_batch gives different bits on {format_ranks(odd)}: the ranks do not start from the same model and batch",
        evidence="; ".join(f"{format_ranks(g)}: inputs {h}" for h, g in inputs.items()),
        ranks=odd,
        fix="something in build_model/make_batch depends on the rank or on unseeded randomness; param_sync names the tensors",
        confidence=0.9,
    )


def _cross_rank_finding(
    payloads: dict[int, dict[str, Any]], view: ConsolidationView, stable: list[int], groups: dict[str, list[int]]
) -> Finding:
    """The ranks whose reproducible reference step gives other bits than the majority's."""
    odd = minority_ranks(groups)
    tie = len(odd) == len(stable)
    base = payloads[max(groups.values(), key=len)[0]]["ref"]
    lines = []
    for r in odd:
        diff = _diff(base, payloads[r]["ref"])
        lines.append(f"rank {r} (host {view.host_of(r)}): differs in {', '.join(diff[:6])}; loss {float.fromhex(payloads[r]['ref']['loss'])!r} vs {float.fromhex(base['loss'])!r}")
    return Finding(
        severity="error",
        issue=(
            f"the same computation gives different bits on {format_ranks(odd)}: "
            + ("the ranks split evenly, so which side is wrong is unknown" if tie else "silent-data-corruption suspect")
        ),
        evidence="\n".join(lines),
        ranks=odd,
        fix=(
            "every rank ran the same model, batch and seed; if the hardware and software are the same (see the env "
            "probe), run the check again and, if the same rank differs, take its device out and run the vendor's diagnostics"
        ),
        confidence=0.5 if tie else 0.8,
    )
