"""`analyze(runs, config) -> Report`: every detector over every run, in the probes' format.

Each detector becomes one ProbeResult of the report (name = detector), so the table, the
JSON (`distdiag.report/1`) and `distdiag report show` work unchanged. The step each finding
marks is kept in the probe's `details["events"]` (for --plot and for scripts).
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime, timezone

from distdiag.analyze.compare import first_parting
from distdiag.analyze.detectors import (
    Detection,
    detect_divergence,
    detect_grad_trend,
    detect_nonfinite,
    detect_overfit,
    detect_plateau,
    detect_repeats,
    detect_spikes,
)
from distdiag.analyze.masking import detect_masked
from distdiag.analyze.series import Run, Series
from distdiag.errors import ConfigError
from distdiag.report.model import Finding, ProbeResult, Report, exit_code_for, verdict_for

__all__ = ["AnalyzeConfig", "analyze", "pick_metric", "DETECTORS"]

DETECTORS = (
    "nonfinite", "masked", "divergence", "spikes", "plateau", "grad_trend", "overfit", "resume", "compare", "monitor"
)
"""The probe names of an analysis report, in order."""

_VAL_MARKERS = ("val", "valid", "validation", "eval", "evaluation", "test", "dev", "holdout")


@dataclass
class AnalyzeConfig:
    """Settings of `distdiag analyze` (CLI flags of the same names)."""

    metric: str | None = None
    """The training-loss metric; default: `loss`, else the one metric named like a training loss."""
    val_metric: str | None = None
    """The validation-loss metric; default: a metric named like val/eval/test loss, if any."""
    grad_metric: str | None = None
    """The gradient-norm metric; default: `grad_norm`, else one named like a gradient norm."""
    spike_factor: float = 2.0
    """A loss spike is a point >= this many times the median of the points before it (> 1)."""
    spike_window: int = 20
    """How many points before a step form its baseline (>= 5)."""
    tolerance: float = 0.05
    """Relative gap beyond which several runs are said to part (0 < tolerance < 1)."""
    plateau_tol: float = 0.05
    """A flat stretch moves less than this fraction of the run's total progress (0 < x < 1)."""

    def __post_init__(self) -> None:
        if not 1.0 < self.spike_factor < float("inf"):  # inf would find no spike and pass
            raise ConfigError(f"analyze.spike_factor must be a finite number > 1, got {self.spike_factor}")
        if not self.spike_window >= 5:
            raise ConfigError(f"analyze.spike_window must be >= 5, got {self.spike_window}")
        if not 0.0 < self.tolerance < 1.0:
            raise ConfigError(f"analyze.tolerance must be within (0, 1), got {self.tolerance}")
        if not 0.0 < self.plateau_tol < 1.0:
            raise ConfigError(f"analyze.plateau_tol must be within (0, 1), got {self.plateau_tol}")


def _is_val(name: str) -> bool:
    tokens = re.split(r"[/_\-. ]+", name.lower())
    return any(t in _VAL_MARKERS or t.startswith(("val", "eval")) for t in tokens)


def pick_metric(run: Run, role: str, explicit: str | None) -> Series | None:
    """Find the train loss ('loss'), the validation loss ('val') or the gradient norm ('grad')."""
    names = list(run.series)
    if explicit:
        if explicit not in run.series:
            raise ConfigError(
                f"{run.source}: no metric {explicit!r}; it has {', '.join(sorted(names)[:12])}"
                + (" ..." if len(names) > 12 else "")
            )
        return run.series[explicit]
    if role == "loss":
        if "loss" in run.series:
            return run.series["loss"]
        cands = [n for n in names if "loss" in n.lower() and not _is_val(n) and n.count("/") <= 1]
        pref = [n for n in cands if "train" in n.lower()] or cands
        pref.sort(key=lambda n: (len(n), n))
        return run.series[pref[0]] if pref else None
    if role == "val":
        cands = [n for n in names if "loss" in n.lower() and _is_val(n)]
        cands.sort(key=lambda n: (len(n), n))
        return run.series[cands[0]] if cands else None
    if "grad_norm" in run.series:
        return run.series["grad_norm"]
    cands = [n for n in names if any(k in n.lower() for k in ("grad_norm", "gradnorm", "grad-norm", "grad/norm", "gnorm"))]
    cands.sort(key=lambda n: (n.count("/"), len(n), n))
    return run.series[cands[0]] if cands else None


def _grad_series(run: Run, main: Series | None) -> list[Series]:
    """The main gradient norm and the per-module ones a TrainingMonitor logs (grad_norm/<module>)."""
    out = [main] if main is not None else []
    out += [s for n, s in run.series.items() if n.startswith(("grad_norm/", "grad_norm_by_module/")) and s is not main]
    return out


def _tag(d: Detection, label: str, several: bool) -> Detection:
    if several:
        d.finding.issue = f"[{label}] {d.finding.issue}"
    return d


def analyze(runs: list[Run], config: AnalyzeConfig | None = None) -> Report:
    cfg = config or AnalyzeConfig()
    started = time.monotonic()
    several = len(runs) > 1
    per: dict[str, list[tuple[str, Detection]]] = {name: [] for name in DETECTORS}
    metrics: dict[str, dict] = {name: {} for name in DETECTORS}
    losses: list[tuple[str, Series]] = []
    for run in runs:
        def add(probe: str, detections: list[Detection], label: str = run.label) -> None:
            per[probe] += [(label, _tag(d, label, several)) for d in detections]

        loss = _detect_run(run, cfg, add)
        if loss is not None:
            losses.append((run.label, loss))
        metrics["nonfinite"][run.label] = {"points": {n: len(s) for n, s in sorted(run.series.items())[:50]}}
    if len(losses) > 1:
        ref_label, ref = losses[0]
        for label, other in losses[1:]:
            per["compare"].append((label, first_parting(ref_label, ref, label, other, tolerance=cfg.tolerance)))
    probes = _probes(per, metrics)
    code = exit_code_for(probes)
    return Report(
        world_size=1,
        probes=probes,
        exit_code=code,
        verdict=verdict_for(code, probes),
        summary=f"{len(runs)} run(s) analysed: " + (_severity_counts(probes) or "nothing found"),
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        duration_s=time.monotonic() - started,
        config={"analyze": asdict(cfg), "runs": [{"label": r.label, "source": r.source} for r in runs]},
    )


def _detect_run(run: Run, cfg: AnalyzeConfig, add: Callable[[str, list[Detection]], None]) -> Series | None:
    """Every detector over one run, each adding its detections; returns the training loss read
    (with masked points back to NaN), or None when the run has none."""
    loss = pick_metric(run, "loss", cfg.metric)
    val = pick_metric(run, "val", cfg.val_metric)
    grad = pick_metric(run, "grad", cfg.grad_metric)
    grads = _grad_series(run, grad)
    others = [s for s in run.series.values() if s is not loss and s not in grads]
    masking = detect_masked(loss, grads, others, run.format)
    add("masked", masking.detections)
    if loss is not None and masking.steps:
        # see through the mask: every other detector reads those points as the NaN they were
        loss = Series(loss.name, list(loss.steps), [math.nan if st in masking.steps else v for st, v in zip(loss.steps, loss.values, strict=True)])
    watched = [s for s in (loss, val, grad) if s is not None] + [s for s in grads if s is not grad]
    nonfinite = detect_nonfinite(watched or list(run.series.values()))
    for d in nonfinite:
        if loss is not None and masking.steps and d.metric == loss.name:
            d.finding.evidence += f"; the log shows finite values at {len(masking.steps)} of these steps (see 'masked')"
    add("nonfinite", nonfinite)
    if loss is None:
        missing = Finding("warning", f"no training-loss metric in {run.source}", f"metrics: {', '.join(sorted(run.series)[:12])}", fix="Name it with --metric.")
        add("divergence", [Detection(missing, None, "")])
    else:
        div = detect_divergence(loss)
        add("divergence", div)
        until = div[0].step if div else None
        add("spikes", detect_spikes(loss, grad, factor=cfg.spike_factor, window=cfg.spike_window, until_step=until))
        add("plateau", detect_plateau(loss, tol=cfg.plateau_tol))
        if val is not None:
            add("overfit", detect_overfit(loss, val))
    for g in _grad_series(run, grad):
        add("grad_trend", detect_grad_trend(g, loss))
    add("monitor", _monitor_detections(run))
    _add_repeats(run, loss, add)
    return loss


def _add_repeats(run: Run, loss: Series | None, add: Callable[[str, list[Detection]], None]) -> None:
    """A resume: the training loss's steps logged twice, with the jump. Other metrics alone repeated
    say nothing (a Lightning CSV writes `epoch` on its training and its validation rows)."""
    if loss is None or loss.name not in run.repeats:
        return
    others = [n for n in run.repeats if n != loss.name]
    add("resume", detect_repeats(loss.name, run.repeats[loss.name], others))


def _monitor_detections(run: Run) -> list[Detection]:
    """The findings a TrainingMonitor wrote into the log; malformed ones are skipped."""
    out = []
    for f in run.monitor_findings:
        try:
            finding = Finding.from_dict(f)
        except (KeyError, TypeError, ValueError):
            continue
        step = f.get("step")
        out.append(Detection(finding, step if isinstance(step, int) else None, "monitor"))
    return out


def _probes(per: dict[str, list[tuple[str, Detection]]], metrics: dict[str, dict]) -> list[ProbeResult]:
    """One ProbeResult per detector, in DETECTORS order; resume, compare and monitor only when they found something."""
    probes = []
    for name in DETECTORS:
        found = per[name]
        if name in ("resume", "compare", "monitor") and not found:
            continue
        events = [
            {"run": label, "step": d.step, "end_step": d.end_step, "metric": d.metric, "severity": d.finding.severity}
            for label, d in found
        ]
        probes.append(
            ProbeResult.from_findings(name, [d.finding for _, d in found], metrics=metrics[name], details={"events": events})
        )
    return probes


def _severity_counts(probes: list[ProbeResult]) -> str:
    """'1 error, 3 warning': the findings per severity, worst first ('' when none)."""
    counts: dict[str, int] = {}
    for p in probes:
        for f in p.findings:
            counts[f.severity] = counts.get(f.severity, 0) + 1
    return ", ".join(f"{counts[s]} {s}" for s in ("critical", "error", "warning", "info") if s in counts)
