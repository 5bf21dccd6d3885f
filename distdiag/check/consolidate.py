"""From what every rank posted to one Report: per-probe consolidation and the verdict."""

from __future__ import annotations

import traceback
from collections.abc import Mapping
from typing import Any

from distdiag.hang import analyze_hang, build_views, ensure_critical, snapshot_details, state_rows
from distdiag.hang.picture import hang_extras
from distdiag.probes.base import ConsolidationView, Probe
from distdiag.report.model import (
    EXIT_CANCELLED,
    EXIT_HANG,
    Finding,
    ProbeResult,
    RankInfo,
    Report,
    exit_code_for,
    now_iso,
    verdict_for,
)
from distdiag.report.render import format_ranks
from distdiag.runtime.blind import blind_spot, mark_blind

__all__ = [
    "consolidate_probe", "build_report", "summary_line", "now_iso", "hang_result", "cancel_result", "after_verdict_result",
]


def _error_findings(name: str, errors: dict[int, dict[str, Any]]) -> list[Finding]:
    groups: dict[tuple[str, str], list[int]] = {}
    for rank, err in sorted(errors.items()):
        groups.setdefault((err["type"], err["message"]), []).append(rank)
    return [
        Finding(
            severity="error",
            issue=f"probe '{name}' raised on {format_ranks(ranks)}: {etype}: {message}",
            evidence=errors[ranks[0]].get("traceback", ""),
            ranks=ranks,
            fix="the exception is shown with its traceback; if it is distdiag's own bug, report it with this report attached",
            confidence=0.9,
        )
        for (etype, message), ranks in groups.items()
    ]


def consolidate_probe(probe: Probe, posted: dict[int, dict[str, Any]], view: ConsolidationView) -> ProbeResult:
    """One probe's result from every rank's posted entry ({status, payload|error|reason})."""
    duration = max((p.get("duration_s", 0.0) for p in posted.values()), default=0.0)
    skipped = {r: p for r, p in posted.items() if p["status"] == "skip"}
    if skipped and len(skipped) == len(posted):
        reasons = sorted({p["reason"] for p in skipped.values()})
        return ProbeResult(probe.name, status="skip", reason="; ".join(reasons), duration_s=duration)
    errors = {r: p["error"] for r, p in posted.items() if p["status"] == "error"}
    if errors:
        return ProbeResult(
            probe.name,
            status="error",
            findings=_error_findings(probe.name, errors),
            duration_s=duration,
            reason=f"raised on {format_ranks(sorted(errors), view.world_size)}",
        )
    payloads = {r: p["payload"] for r, p in posted.items() if p["status"] == "ok"}
    try:
        result = probe.consolidate(payloads, view)
    except Exception as exc:  # noqa: BLE001 - a consolidation bug must not lose the report
        return ProbeResult(
            probe.name,
            status="error",
            findings=[
                Finding(
                    severity="error",
                    issue=f"consolidating probe '{probe.name}' failed: {type(exc).__name__}: {exc}",
                    evidence=traceback.format_exc(limit=6),
                    fix="a bug in distdiag: report it with this report attached",
                )
            ],
            duration_s=duration,
            reason="consolidation failed",
        )
    if skipped:
        result.findings.append(
            Finding(
                severity="info",
                issue=f"probe '{probe.name}' skipped on {format_ranks(sorted(skipped))}",
                evidence="; ".join(sorted({p['reason'] for p in skipped.values()})),
                ranks=sorted(skipped),
            )
        )
    result.duration_s = duration
    return result


BUILTIN_MODEL = "built-in model"
"""metrics["model"] of a probe that checked distdiag's own workload (no --target)."""


def mark_builtin_model(probes: list[ProbeResult]) -> None:
    """Without a target, the probes that check a model ran on distdiag's own workloads: say so
    in their metrics, which the table and the verdict line show (a PASS must say what it checked)."""
    from distdiag.probes import PROBES

    for result in probes:
        cls = PROBES.get(result.name)
        if cls is not None and cls.checks_a_model and result.status in ("pass", "warn", "fail"):
            result.metrics["model"] = BUILTIN_MODEL


def _builtin_note(report: Report) -> str:
    builtin = [p.name for p in report.probes if p.metrics.get("model") == BUILTIN_MODEL]
    if not builtin:
        return ""
    return f"; {len(builtin)} ran on the {BUILTIN_MODEL}: checks the stack, not your model (--target checks yours)"


def summary_line(report: Report) -> str:
    worst = report.findings("warning")
    if report.exit_code == 0 and not worst:
        ran = [p for p in report.probes if p.status != "skip"]
        skipped = len(report.probes) - len(ran)
        tail = f"; {skipped} skipped" if skipped else ""
        return f"all {len(ran)} probe(s) that ran passed on {report.world_size} rank(s){tail}{_builtin_note(report)}"
    if report.exit_code == 0:
        return f"passed with {len(worst)} warning(s){_builtin_note(report)}"
    order = {"critical": 0, "error": 1, "warning": 2}
    worst.sort(key=lambda nf: order.get(nf[1].severity, 3))
    name, top = worst[0] if worst else ("", None)
    lead = f"{name}: {top.issue}" if top else report.outcome
    more = f" (+{len(worst) - 1} more finding(s))" if len(worst) > 1 else ""
    return lead + more


def build_report(
    *,
    world_size: int,
    ranks: list[RankInfo],
    probes: list[ProbeResult],
    not_run: list[str],
    outcome: str,
    hung: bool,
    restart_count: int,
    run_id: str,
    duration_s: float,
    config: dict[str, Any],
    written_by: int,
) -> Report:
    if not config.get("target"):
        mark_builtin_model(probes)
    code = EXIT_CANCELLED if outcome == "cancelled" else exit_code_for(probes, hung=hung)
    report = Report(
        world_size=world_size,
        probes=probes,
        ranks=ranks,
        exit_code=code,
        verdict=verdict_for(code, probes),
        outcome=outcome if code in (EXIT_HANG, EXIT_CANCELLED) or outcome != "completed" else "completed",
        not_run=not_run,
        restart_count=restart_count,
        run_id=run_id,
        created=now_iso(),
        duration_s=duration_s,
        config=config,
        written_by=written_by,
    )
    report.summary = summary_line(report)
    return report


def hang_result(
    name: str,
    snaps: dict[int, dict[str, Any]],
    lost: Mapping[int, str],
    errors: dict[int, dict[str, Any]],
    world: int,
    *,
    timeout_s: float,
    reason: str,
    duration_s: float,
    infos: dict[int, RankInfo] | None = None,
) -> ProbeResult:
    """The result of the step during which the run ended (`infos`: the rank table, for the
    hosts and pids of lost ranks)."""
    what = f"probe '{name}'" if name not in ("setup", "final") else f"the {name} phase"
    findings = analyze_hang(snaps, lost, errors, world, what=what, timeout_s=timeout_s, raise_ends_run=True)
    ensure_critical(
        findings,
        f"the run ended during {what}: {reason}",
        "ranks' states at the end are in this probe's details",
        "see the other findings and the per-rank stacks",
    )
    findings = mark_blind(findings, blind_spot(snaps=snaps.values()))  # NCCL blocking wait: the recorder does not move
    details = {"table:ranks at the end": state_rows(snaps, lost, world, infos), **snapshot_details(snaps)}
    details.update(hang_extras(findings, build_views(snaps, lost), lost, errors, world))
    return ProbeResult(name, status="error", findings=findings, duration_s=duration_s, details=details, reason=reason)


def cancel_result(
    name: str, snaps: dict[int, dict[str, Any]], world: int, *, reason: str, duration_s: float
) -> ProbeResult:
    """The result of the step a cancelled run (every rank signalled, none lost) stopped in:
    where each rank was, and nobody blamed."""
    what = f"probe '{name}'" if name not in ("setup", "final") else f"the {name} phase"
    finding = Finding(
        severity="critical",
        issue=f"the run was cancelled during {what}: every rank that answered was told to stop by a signal ({reason})",
        evidence="no rank was lost and none raised; where each rank was is in the table below",
        ranks=[],
        fix=(
            "nothing points at a rank: rerun the check; if nobody cancelled it, look at what sent the signal "
            "(the scheduler's time limit or preemption, an OOM killer acting on the launcher)"
        ),
        confidence=0.8,
    )
    details = {"table:ranks at the end": state_rows(snaps, {}, world), **snapshot_details(snaps)}
    return ProbeResult(name, status="error", findings=[finding], duration_s=duration_s, details=details, reason=reason)


def after_verdict_result(lost: Mapping[int, str]) -> ProbeResult:
    """Ranks that were stopped or died after the verdict was written, before they left."""
    ranks = sorted(lost)
    finding = Finding(
        severity="critical",
        issue=f"{format_ranks(ranks)} did not leave after the verdict: {lost[ranks[0]]}",
        evidence="; ".join(f"rank {r}: {why}" for r, why in sorted(lost.items())) + "; stopped ranks on this host were ended by pid",
        ranks=ranks,
        fix=(
            "the probes passed on these ranks, but their processes stopped or died right after: look at the node "
            "(dmesg, the OOM killer, a debugger or a job-control signal) before trusting it with a job"
        ),
        confidence=0.9,
    )
    return ProbeResult("final", status="error", findings=[finding], reason="a rank did not leave after the verdict")
