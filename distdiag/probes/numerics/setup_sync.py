"""`setup_sync`: the model as set up, before the first step: equal on every rank, in the right
dtype and on the right device.

Every rank builds the model once more with `build_model` (seeded as distdiag always seeds it)
and digests each parameter and buffer *before* `parallelize`, because after FSDP2's
`fully_shard` each rank keeps only its slice of its own copy: a checkpoint loaded on rank 0
alone, or an init seeded per rank, then becomes a model no rank holds whole and no later
comparison of shards can see. setup_digest.classify names the mechanism. The same build
gives a forward of `loss_fn` on this rank's part of step 1 (the loss's dtype), and the
parallel model (shared with the other numerics probes) is walked for devices and for the
dtype the optimizer steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from distdiag.errors import ConfigError, exc_line
from distdiag.probes import training as tr
from distdiag.probes.base import ConsolidationView
from distdiag.probes.causes import ProbeCause
from distdiag.probes.numerics.parity_report import setup_failure
from distdiag.probes.numerics.setup_after import after_parallel, differing_names
from distdiag.probes.numerics.setup_digest import SAMPLE, digest_model
from distdiag.probes.numerics.setup_findings import divergence_findings, eval_modules, layout_findings, mode_findings
from distdiag.probes.numerics.setup_placement import (
    loss_findings,
    placement_findings,
    placement_rows,
    precision_findings,
    precision_rows,
)
from distdiag.report.model import Finding, ProbeResult

if TYPE_CHECKING:
    from distdiag.runtime.context import RankContext

__all__ = ["SetupSyncProbe", "SetupSyncConfig"]


@dataclass
class SetupSyncConfig:
    """Options of the setup_sync probe, the `[probes.setup_sync]` table."""

    workload: str = "transformer"
    """Built-in workload used without a target: mlp or transformer."""
    parallel: bool = True
    """Also walk the parallel model (after parallelize) for devices and parameter dtypes."""

    def __post_init__(self) -> None:
        tr.check_workload("probes.setup_sync.workload", self.workload)
        if not isinstance(self.parallel, bool):
            raise ConfigError(f"probes.setup_sync.parallel must be true or false, got {self.parallel!r}")


class SetupSyncProbe(tr.NumericsProbe):
    name = "setup_sync"
    summary = ("parameters and buffers that differ across ranks before the first step (loaded on one rank, "
               "rank-seeded init), dtypes, devices and the loss's precision of the model as set up")
    Config = SetupSyncConfig
    shared_fields = ("digests", "built", "parallel", "precision")
    """Stored once for all ranks (issue 21): the model as built and parallelized: the same on every rank of a healthy job."""

    def skip_reason(self, ctx: RankContext) -> str | None:
        target = getattr(ctx, "target", None)
        if target is not None and not target.has("build_model"):
            return f"probe '{self.name}' needs hook build_model() in target {target.spec}"
        return None

    def run(self, ctx: RankContext) -> dict[str, Any]:
        opts: SetupSyncConfig = self.options(ctx)
        target = getattr(ctx, "target", None)
        data_parallel = tr.layout_reason(ctx, self.name) is None
        hooks = _hooks(ctx, opts.workload)
        payload: dict[str, Any] = {
            "source": hooks.source, "device": str(ctx.device),
            "experts_by_design": bool(target is not None and target.has("route")),
        }
        model = None
        try:
            model = hooks.model(ctx.seed)
            payload["digests"] = digest_model(model)
            payload["eval_modules"] = eval_modules(model)
            payload["built"] = placement_rows(model)
        except tr.HookError as exc:
            payload["setup_error"] = str(exc)
        except Exception as exc:  # noqa: BLE001 - every rank must still reach parallel_run's collectives
            payload["setup_error"] = f"setup_sync could not digest the model as built: {exc_line(exc)}"
        names = differing_names(ctx, payload.get("digests"))  # two all_reduces, on every rank
        if model is not None and data_parallel and (target is None or target.has("make_batch")):
            try:
                payload["loss"] = _loss_dtype(ctx, hooks, model)
            except tr.HookError as exc:
                payload["loss"] = {"error": str(exc)}
            except Exception as exc:  # noqa: BLE001 - as above: no rank leaves before the shared setup
                payload["loss"] = {"error": f"setup_sync's loss forward failed: {exc_line(exc)}"}
        if data_parallel and opts.parallel and target_ok_for_parallel(target):
            from distdiag.probes.numerics.shared import parallel_run

            run = parallel_run(ctx, opts.workload)  # shared: built once for the numerics probes
            if not run.failed and run.model is not None:
                payload["parallel"] = placement_rows(run.model)
                payload["precision"] = precision_rows(run.model, ctx.world_size)
                if names and model is not None:
                    # The build-time copy is held until here only when something differs.
                    payload["after"] = after_parallel(ctx, model, run.model, names)
        del model
        return payload

    def consolidate(self, payloads: dict[int, dict[str, Any]], view: ConsolidationView) -> ProbeResult:
        if (failed := setup_failure(self.name, payloads, "digests")) is not None:
            return failed
        ranks = sorted(payloads)
        digests = {r: payloads[r]["digests"] for r in ranks}
        findings, compared, skipped = layout_findings(digests)
        after = {r: payloads[r]["after"] for r in ranks} if all("after" in payloads[r] for r in ranks) else None
        findings += divergence_findings(digests, skipped, payloads[ranks[0]]["experts_by_design"], after)
        findings += mode_findings(payloads)
        findings += placement_findings(payloads, view)
        findings += loss_findings(payloads)
        findings += precision_findings(payloads)
        meta = sum(1 for d in digests[ranks[0]].values() if "bits" not in d)
        findings.append(Finding(
            severity="info",
            issue=f"compared {compared} parameter(s) and buffer(s) of {payloads[ranks[0]]['source']} as built, before parallelize",
            evidence=(f"a hash of the bytes, sum, sum of squares and a {SAMPLE}-element strided sample per tensor"
                      + (f"; {meta} tensor(s) on meta (deferred init) not compared" if meta else "")),
        ))
        metrics = {"tensors": compared, "differing": sum(1 for f in findings if f.cause.startswith(ProbeCause.SETUP_DIVERGENCE))}
        return ProbeResult.from_findings(self.name, findings, metrics=metrics)


def target_ok_for_parallel(target: Any) -> bool:
    """The shared parallel run needs make_batch too (it shards step batches later)."""
    return target is None or target.has("make_batch")


def _hooks(ctx: RankContext, workload: str) -> tr.Hooks:
    target = getattr(ctx, "target", None)
    if target is not None and not target.has("make_batch"):
        # resolve_hooks wants make_batch; the build-time check needs only build_model.
        return tr.Hooks(source=f"target {target.spec}", build_model=target.build_model, make_batch=lambda s: None,
                        loss_fn=tr.default_loss, parallelize=tr.default_parallelize, shard_batch=lambda b, r, w: b,
                        build_optimizer=lambda p: None)  # type: ignore[arg-type,return-value]  # never called here
    return tr.resolve_hooks(ctx, workload)


def _loss_dtype(ctx: RankContext, hooks: tr.Hooks, model: torch.nn.Module) -> dict[str, Any]:
    """The dtype of this rank's loss on its part of step 1, from the model as built (no backward)."""
    devices = {t.device.type for t in list(model.parameters()) + list(model.buffers())}
    if devices - {ctx.device.type}:
        return {"skipped": f"the model as built is on {', '.join(sorted(devices))}, not {ctx.device.type}"}
    if hooks.train_step is not None and hooks.loss_fn is tr.default_loss:
        return {"skipped": "the target's train_step computes its own loss and there is no loss_fn"}
    shard = hooks.shard(hooks.batch(1), ctx.rank, ctx.world_size)
    ctx.seed()
    with torch.no_grad():
        loss = tr.call_loss(hooks, model, shard)
    if not isinstance(loss, torch.Tensor):
        return {"skipped": f"loss_fn returned {type(loss).__name__}"}
    return {"dtype": str(loss.dtype).replace("torch.", "")}
