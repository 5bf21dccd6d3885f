"""loss_parity's consolidation: from every rank's comparisons to findings and a step table."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from distdiag.probes.base import ConsolidationView
from distdiag.probes.causes import ProbeCause
from distdiag.probes.numerics import diagnose_rules as rules
from distdiag.probes.numerics.diagnose import Diagnosis, ParityEvidence, diagnose_parity, ratio_to_integer
from distdiag.probes.numerics.localise_read import read_localised
from distdiag.probes.numerics.parity_evidence import RATIO_HIGH, accumulation_differs, one_backward
from distdiag.report.model import Finding, ProbeResult
from distdiag.report.render import format_ranks

__all__ = ["consolidate_parity", "setup_failure"]


def _setup_findings(name: str, payloads: dict[int, dict[str, Any]]) -> list[Finding]:
    errors: dict[str, list[int]] = {}
    for rank, p in sorted(payloads.items()):
        if p.get("setup_error"):
            errors.setdefault(p["setup_error"], []).append(rank)
    if not errors:
        return [Finding(
            severity="error",
            issue=f"probe '{name}' could not set up on some rank, but no rank said why",
            ranks=sorted(payloads),
        )]
    # No probe name in front: the report shows the issue under the probe's row and the
    # verdict line adds the name itself ("loss_parity: loss_parity: ..." otherwise).
    out = []
    for msg, ranks in errors.items():
        source = payloads[ranks[0]].get("source", "?")
        builtin = source.startswith("built-in workload")
        out.append(Finding(
            severity="error",
            issue=("distdiag's built-in workload failed: " if builtin else "") + msg
            + ("" if len(ranks) == len(payloads) else f" (on {format_ranks(ranks)})"),
            evidence=f"hooks from {source}; the comparison did not run",
            ranks=ranks,
            fix=_setup_fix(builtin),
        ))
    return out


def _setup_fix(builtin: bool) -> str:
    """What to do: fix the user's hook, or - distdiag's own workload failing - report it."""
    if builtin:
        # The built-in workloads are sized for every world (distdiag.workloads.fit_world): one
        # failing is distdiag's bug, never a hook the user wrote.
        return ("this is distdiag's own workload failing, not a hook of yours: report it with this report attached, "
                "and run the probe on your model with --target (docs/targets.md)")
    return "fix the hook named above (docs/targets.md gives each hook's signature and what it must return)"


def setup_failure(name: str, payloads: dict[int, dict[str, Any]], key: str) -> ProbeResult | None:
    """The result when some rank's payload lacks ``key`` (its setup failed), else None."""
    if any(key not in p for p in payloads.values()):
        return ProbeResult.from_findings(name, _setup_findings(name, payloads))
    return None


def _merge_bad(ranks: list[int], steps: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    """_merge_cmp of one step's `kind` comparison (`steps[k]` is ranks[k]'s record of the step)."""
    cmps = [s[kind] for s in steps]
    if not any(c["bad"] or c.get("bad_names") for c in cmps):
        return {}  # nothing over tolerance anywhere (a healthy step): no per-rank merge
    return _merge_cmp(dict(zip(ranks, cmps, strict=True)))


def _merge_cmp(cmps: dict[int, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every rank's tensors over tolerance, by name, with the largest error and the ranks."""
    merged: dict[str, dict[str, Any]] = {}
    for rank, cmp in sorted(cmps.items()):
        detailed = {b["name"] for b in cmp["bad"]}
        for item in cmp["bad"] + [{"name": n, "rel": 0.0, "abs": 0.0, "tol": 0.0} for n in cmp.get("bad_names", []) if n not in detailed]:
            entry = merged.setdefault(item["name"], {**item, "ranks": []})
            entry["ranks"].append(rank)
            if item["rel"] > entry["rel"]:
                entry.update(rel=item["rel"], abs=item["abs"])
            entry["tol"] = max(entry.get("tol", 0.0), item.get("tol", 0.0))  # a name only listed on one rank has no tol
    return merged


def _module_of(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else "(root)"


def consolidate_parity(name: str, payloads: dict[int, dict[str, Any]], view: ConsolidationView) -> ProbeResult:
    if (failed := setup_failure(name, payloads, "steps")) is not None:
        return failed
    ranks = sorted(payloads)
    first = payloads[ranks[0]]
    world = view.world_size
    order: list[str] = next((s["order"] for s in first["steps"] if s.get("order")), []) or []
    findings: list[Finding] = []
    table = _StepTable(payloads, ranks, world)
    divergent = table.divergent
    accum = first.get("accumulation")
    accum_bad = accumulation_differs(accum)
    if divergent:
        evidence = _evidence(payloads, divergent, world, order, accum_bad)
        findings.append(_divergence_finding(divergent, evidence, ranks))
    elif (split := ref_split(payloads, len(table.rows) - 1)) is not None:
        # Within tolerance, but the reference differs across ranks: each rank was compared with its own.
        diag = rules.rank_dependent(ParityEvidence(
            step=split["step"], world=world, loss_rel=0.0, loss_tol=0.0, mean_loss=0.0, ref_loss=0.0, grad_tol=0.0,
            gbad={}, pbad={}, rank_sums={}, train_step=bool(first.get("train_step")), ref_split=split))
        assert diag is not None
        findings.append(Finding(
            severity="warning", issue=f"the parallel run stays within tolerance, but {diag.mechanism}",
            evidence="\n".join(diag.evidence), fix=diag.fix, confidence=diag.confidence, cause=diag.cause,
            ranks=ranks))
    if accum is not None:
        findings.extend(_accumulation_findings(accum, accum_bad))
    findings.append(Finding(
        severity="info",
        issue=f"compared {len(table.rows)} step(s) of {first['source']} on {world} rank(s) against a 1-process reference",
        evidence=(
            f"defaults used: {', '.join(first['defaults']) or 'none'}; optimizer: {first['optimizer']}; "
            f"max rel err: loss {table.max_loss_rel:.2e}, grads {table.max_grad_rel:.2e}, params {table.max_param_rel:.2e}"
        ),
    ))
    metrics = {
        "steps": len(table.rows), "first_divergent_step": divergent.step if divergent else None,
        "max_loss_rel_err": table.max_loss_rel, "max_grad_rel_err": table.max_grad_rel, "max_param_rel_err": table.max_param_rel,
        "reference_model_bytes": first.get("model_bytes"),
        "slowest_rank_time_s": max(p.get("time_s", 0.0) for p in payloads.values()),
    }
    return ProbeResult.from_findings(name, findings, metrics=metrics, details={"table:loss parity": table.rows})


@dataclass
class _Divergence:
    """The first step where the parallel run is off: what is over tolerance, and the losses."""

    step: int
    index: int
    gbad: dict[str, dict[str, Any]]
    pbad: dict[str, dict[str, Any]]
    loss_rel: float
    loss_tol: float
    mean_loss: float
    ref_loss: float
    losses: list[float]


class _StepTable:
    """The step table over all ranks, the largest relative errors, and the first step that diverges."""

    def __init__(self, payloads: dict[int, dict[str, Any]], ranks: list[int], world: int) -> None:
        self.rows: list[dict[str, Any]] = []
        self.divergent: _Divergence | None = None
        self.max_grad_rel = self.max_param_rel = self.max_loss_rel = 0.0
        for i, s0 in enumerate(payloads[ranks[0]]["steps"]):
            self._step(payloads, ranks, world, i, s0)

    def _step(self, payloads: dict[int, dict[str, Any]], ranks: list[int], world: int, i: int, s0: dict[str, Any]) -> None:
        """Step i's row (`s0` is the first rank's record of it)."""
        steps = [payloads[r]["steps"][i] for r in ranks]  # looked up once (16k ranks, issue 21)
        losses = [s["loss"] for s in steps]
        mean_loss = sum(losses) / len(losses)
        ref_loss = s0["ref_loss"]
        loss_rel = abs(mean_loss - ref_loss) / max(abs(ref_loss), 1e-12)
        loss_tol = _loss_tol(s0)
        par_norm = math.sqrt(max(sum([s["grad_sq_share"] for s in steps]), 0.0))
        grads, params = [s["grad"] for s in steps], [s["param"] for s in steps]
        grad_rel = max([g["max_rel"] for g in grads])
        param_rel = max([p["max_rel"] for p in params])
        grad_abs = max([g["max_abs"] for g in grads])
        self.max_grad_rel = max(self.max_grad_rel, grad_rel)
        self.max_param_rel = max(self.max_param_rel, param_rel)
        self.max_loss_rel = max(self.max_loss_rel, loss_rel)
        gbad, pbad = _merge_bad(ranks, steps, "grad"), _merge_bad(ranks, steps, "param")
        off = bool(gbad or pbad or loss_rel > loss_tol)
        self.rows.append({
            "step": s0["step"], "ref loss": f"{ref_loss:.6g}", f"loss (mean of {world})": f"{mean_loss:.6g}",
            "loss rel err": f"{loss_rel:.2e}", "ref grad norm": f"{s0['ref_grad_norm']:.5g}",
            "grad norm": f"{par_norm:.5g}", "grad rel err": f"{grad_rel:.2e}", "grad abs err": f"{grad_abs:.2e}",
            "param rel err": f"{param_rel:.2e}", "tolerance": f"{loss_tol:.0e}", "ok": "no" if off else "yes",
        })
        if off and self.divergent is None:
            self.divergent = _Divergence(s0["step"], i, gbad, pbad, loss_rel, loss_tol, mean_loss, ref_loss, losses)


def _evidence(payloads: dict[int, dict[str, Any]], d: _Divergence, world: int, order: list[str],
              accum_bad: bool) -> ParityEvidence:
    """What the diagnosis reads: the divergent step's errors and factors, and the state before step 1."""
    ranks = sorted(payloads)
    first = payloads[ranks[0]]
    setups = {r: p.get("setup") for r, p in payloads.items()}
    setup_bad = _merge_cmp({r: s["param"] for r, s in setups.items() if s}) if all(setups.values()) else {}
    return ParityEvidence(
        step=d.step, world=world, loss_rel=d.loss_rel, loss_tol=d.loss_tol, mean_loss=d.mean_loss,
        ref_loss=d.ref_loss, grad_tol=d.loss_tol, gbad=d.gbad, pbad=d.pbad,
        rank_sums={r: p["steps"][d.index]["grad"].get("sums", [0.0] * 4) for r, p in payloads.items()},
        order=order, setup_bad=setup_bad,
        ref_differs=_ref_differs({r: s["ref_bits"] for r, s in setups.items() if s}),
        accum_bad=accum_bad, accum_parts=(first.get("accumulation") or {}).get("parts") if accum_bad else None,
        train_step=bool(first.get("train_step")), groups={"dp": world},
        sharded_params=next((s.get("sharded", 1) for s in first["steps"] if s.get("order")), 1),
        fsdp=next((s.get("fsdp") for s in first["steps"] if s.get("order")), None),
        counts={r: p["steps"][d.index].get("counts") or {} for r, p in payloads.items()},
        cross_sample=next((s.get("cross_sample") or [] for s in first["steps"] if s.get("order")), []),
        ref_counts=first["steps"][d.index].get("ref_counts") or {},
        ref_split=ref_split(payloads, d.index),
        reducer=next((s.get("reducer") for s in first["steps"] if s.get("order")), None),
        trainable_diff=next((s.get("trainable_diff") or {} for s in first["steps"] if s.get("order")), {}),
        accum_equal=_accum_equal(first.get("accumulation")),
        localised={r: p["localised"] for r, p in payloads.items() if p.get("localised")},
        rank_losses=list(d.losses),
        ddp_unreduced=next((s.get("ddp_unreduced") for s in first["steps"] if s.get("order")), None),
    )


REF_SPLIT_REL = 1e-6
"""The reference runs the same hooks on the same global batch with the same seed on every rank, so its loss
and gradient norm agree bit for bit (the determinism probe holds them to it); 1e-6 leaves room for a
reduction order that differs between GPU models, far below any setting that reads the rank."""


def ref_split(payloads: dict[int, dict[str, Any]], last: int) -> dict[str, Any] | None:
    """The first step (index <= last) where the reference's loss, or the gradient norm it stepped with, differs
    across ranks: a hook that computes differently per rank (it reads the rank, or a per-rank config)."""
    ranks = sorted(payloads)
    for i in range(last + 1):
        for key, what in (("ref_loss", "loss"), ("ref_grad_norm", "grad norm")):
            values = {r: payloads[r]["steps"][i].get(key) for r in ranks}
            if any(v is None for v in values.values()):
                return None
            lo, hi = min(values.values()), max(values.values())
            if hi - lo > REF_SPLIT_REL * max(abs(hi), abs(lo), 1e-12):
                return {"step": payloads[ranks[0]]["steps"][i]["step"], "what": what, "values": values, "index": i}
    return None


def _ref_differs(bits: dict[int, dict[str, str]]) -> dict[str, list[list[int]]]:
    """Reference tensors whose bits are not the same on every rank: name -> groups of agreeing ranks."""
    out: dict[str, list[list[int]]] = {}
    if len(bits) < 2:
        return out
    names = next(iter(bits.values()))
    for name in names:
        groups: dict[str, list[int]] = {}
        for r in sorted(bits):
            groups.setdefault(bits[r].get(name, "absent"), []).append(r)
        if len(groups) > 1:
            out[name] = list(groups.values())
    return out


def _divergence_finding(d: _Divergence, ev: ParityEvidence, ranks: list[int]) -> Finding:
    """The error for the first divergent step: the mechanism the evidence supports, and where it shows."""
    bad = d.gbad or d.pbad
    top = sorted(bad.values(), key=lambda b: -b["rel"])[:5]
    what = "gradients" if d.gbad else "parameters" if d.pbad else "loss"
    diag = _with_localised(diagnose_parity(ev), ev)
    lines = [
        f"step {d.step}: loss {d.mean_loss:.6g} (mean of ranks' losses {', '.join(f'{x:.6g}' for x in d.losses)}) "
        f"vs reference {d.ref_loss:.6g}: rel err {d.loss_rel:.2e} (tolerance {d.loss_tol:.0e})",
        f"mechanism: {diag.mechanism} (cause {diag.cause})",
        *(f"  {line}" for line in diag.evidence),
    ]
    if bad:
        position = {n: i for i, n in enumerate(ev.order)}
        first = min(bad, key=lambda n: position.get(n, 1 << 30))
        lines.append(f"{len(bad)} parameter(s) over tolerance; first in model order: {first}")
        lines += _worst_lines(top, "grad" if d.gbad else "param")
    worst = max(bad.values(), key=lambda b: b["rel"])["name"] if bad else ""
    where = "" if not bad else ", every tensor by one factor per rank" if diag.uniform else f", largest error in module {_module_of(worst)}"
    located = [rec["first"]["name"] for _, rec in sorted(ev.localised.items()) if rec and rec.get("first")]
    if where and not diag.uniform and located and located[0] != _module_of(worst):
        # where it starts leads (the first module to compute differently), where it is largest follows
        where = f", starting in module {located[0] or '(root)'} (the first to compute differently from the same inputs){where}"
    ranks_bad = sorted({r for b in bad.values() for r in b["ranks"]}) or ranks
    when = "before step 1" if diag.cause == ProbeCause.SETUP_DIVERGENCE else f"at step {d.step}: {what} differ{where}"
    return Finding(
        severity="error",
        issue=f"the {ev.world}-rank run diverges from the 1-process reference {when}: {diag.mechanism}",
        evidence="\n".join(lines),
        ranks=ranks_bad,
        fix=diag.fix,
        confidence=diag.confidence,
        cause=diag.cause,
    )


def _with_localised(diag: Diagnosis, ev: ParityEvidence) -> Diagnosis:
    """The rules' diagnosis, or the module-by-module one where the rules are not confident and it names something
    (a module whose own computation differs rules out a mechanism outside it); its lines are added either way."""
    found, lines = read_localised(ev)
    if found is not None and diag.confidence < 0.8:
        return found
    if found is not None and found.cause != ProbeCause.MECHANISM_NOT_IDENTIFIED and found.confidence > diag.confidence:
        # Ordered by evidence: a rerun that reproduces the rank's output from the reference's module with one piece
        # of the rank's (an attribute, a dtype, a forward) shows how; a rule's inference shows where. How leads.
        return replace(diag, cause=found.cause, confidence=found.confidence, mechanism=f"{found.mechanism}; {diag.mechanism}",
                       fix=f"{found.fix}; {diag.fix}", evidence=[*diag.evidence, *lines])
    if found is not None and found.cause not in (diag.cause, ProbeCause.MECHANISM_NOT_IDENTIFIED):
        # The rules are sure of the place (e.g. a hook that computes differently per rank) and the
        # modules say how (a lower compute dtype, a dropout, an attribute): both go to the lead and the fix.
        diag = replace(diag, mechanism=f"{diag.mechanism}; module by module: {found.mechanism}",
                       fix=f"{found.fix}; {diag.fix}")
    if lines:
        return replace(diag, evidence=[*diag.evidence, *lines])
    return diag


def _worst_lines(top: list[dict[str, Any]], kind: str) -> list[str]:
    """One evidence line for each of the tensors furthest over tolerance."""
    lines = []
    for b in top:
        if b.get("detail"):
            lines.append(f"  {b['name']}: {b['detail']} on {format_ranks(b['ranks'])}")
            continue
        lines.append(
            f"  {b['name']}: {kind} rel err {b['rel']:.3g}, max abs err {b['abs']:.3g} "
            f"(tolerance {b['tol']:.0e}) on {format_ranks(b['ranks'])}"
        )
    return lines


def _loss_tol(step: dict[str, Any]) -> float:
    import torch

    from distdiag.probes.training import rtol_for

    dtype = getattr(torch, step.get("dtype", "float32"), torch.float32)
    return rtol_for(dtype)


def _accum_equal(accum: dict[str, Any] | None) -> bool | None:
    """Whether train_step gave one loss_fn backward's gradients in the reference process; None when not told
    (no train_step, or a train_step that changes module state itself, so the two did not start alike)."""
    return None if not accum or accum.get("state_changed") else accum["equal"]


def _state_changed(accum: dict[str, Any]) -> Finding:
    """train_step advances module state itself: the accumulation check compared two steps from different states."""
    return Finding(
        severity="info",
        issue=("train_step changes module state that one loss_fn backward leaves as it is "
               f"({', '.join(accum['state_changed'])}): its gradients are not compared with loss_fn's"),
        evidence=(f"reference process, step 1: train_step's gradients differ from one loss_fn backward's (max rel "
                  f"err {accum['max_rel']:.3g}), but the two did not start from the same state; every step is "
                  "still compared with the reference's"),
    )


def _micro_batches_told(told: Diagnosis, top: str) -> Finding:
    """The accumulation warning when the micro-batches' weights name the mechanism."""
    return Finding(
        severity="warning",
        issue=f"gradient accumulation in train_step is not equivalent to one step on the same global batch: {told.mechanism}",
        evidence=f"reference process, step 1: {top}\n" + "\n".join(told.evidence), fix=told.fix,
        confidence=told.confidence, cause=told.cause,
    )


def _one_backward(accum: dict[str, Any]) -> Finding:
    """train_step ran one backward and changed the gradients after it: nothing accumulated to judge."""
    return Finding(
        severity="info",
        issue=("train_step changes the gradients between its one backward and the optimizer step, not by one "
               f"factor (max rel err {accum['max_rel']:.3g} against one loss_fn backward): no accumulation to check"),
        evidence=("reference process, step 1: one backward pass reached the parameters; a clip by value, a gradient "
                  "hook or a forward that changes the weights does this; every step is still compared with the "
                  "reference's train_step"),
    )


def _accumulation_findings(accum: dict[str, Any], bad: bool) -> list[Finding]:
    if accum["equal"]:
        return []
    if accum.get("state_changed"):
        return [_state_changed(accum)]
    exact = ratio_to_integer(accum["factor"])
    if one_backward(accum) and accum["scaled_resid"] > 1e-3:
        return [_one_backward(accum)]
    if not bad and exact is not None and exact[1] <= RATIO_HIGH:
        k, _, inverted = exact
        shown = f"1/{k}" if inverted else f"{k}"
        return [Finding(
            severity="warning",
            issue=(f"train_step's gradients are exactly {shown} of one loss_fn backward on the same global batch "
                   f"(factor {accum['factor']:.8g}): not clipping, which scales by max_norm / norm, no exact ratio"),
            evidence=(f"reference process, step 1: total norm {accum['plain_norm']:.5g} with loss_fn, "
                      f"{accum['stepped_norm']:.5g} as train_step steps; every tensor scaled alike (residual "
                      f"{accum['scaled_resid']:.1e})\ncandidates: " + (
                          f"each micro-batch's loss divided by the number of micro-batches ({k}) while the loss already "
                          "normalises over the global batch (a global token count), or a loss scale not undone"
                          if inverted else f"micro-batch losses that are each a mean over the whole batch, summed {k} "
                          "times, or a loss scale not undone") + "\nwhat would decide: the normalisation loss_fn "
                     "applies (a global count: the extra division is the bug; a micro-batch mean: train_step is right "
                     "and loss_fn is not one step on the global batch)"),
            fix=(f"scale the accumulated loss once: when loss_fn already divides by the global count, sum the "
                 f"micro-batch losses without dividing by {k}" if inverted else
                 f"divide the sum of micro-batch losses by {k}, or let loss_fn normalise by the global count"),
            confidence=0.7,
            cause=ProbeCause.GRAD_ACCUMULATION_SCALED,
        )]
    if not bad:
        return [Finding(
            severity="info",
            issue=(
                f"train_step clips gradients: it steps with the global-batch gradients scaled by {accum['factor']:.4g} "
                f"(total norm {accum['plain_norm']:.5g} -> {accum['stepped_norm']:.5g})"
            ),
            evidence="the clipped gradients are compared with the reference's at every step",
        )]
    top = "; ".join(f"{b['name']} rel err {b['rel']:.3g}" for b in accum["bad"][:4])
    if accum.get("parts") and (told := rules.microbatch_diagnosis(accum["parts"])) is not None:
        return [_micro_batches_told(told, top)]
    return [Finding(
        severity="warning",
        issue=(
            "gradient accumulation in train_step is not equivalent to one step on the same global batch: "
            f"its gradients differ from loss_fn's (max rel err {accum['max_rel']:.3g}, not a uniform clipping factor)"
        ),
        evidence=f"reference process, step 1: {top}\ncandidates: {rules.ACCUM_CANDIDATES}\nwhat would decide: "
                 f"{rules.ACCUM_DECIDES}",
        fix=(
            "if train_step averages micro-batch means: sum per-token (or per-sample) losses over the micro-batches and "
            "divide once by the global count (averaging micro-batch means weights tokens unequally when micro-batches "
            "hold different counts); if it clips inside the loop: clip once after the last micro-batch"
        ),
        confidence=0.6,
        cause=ProbeCause.GRAD_ACCUMULATION_MEANS,
    )]
