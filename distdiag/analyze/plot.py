"""`--plot PATH`: an image of the curves with the findings marked (matplotlib, an optional extra).

Readable first: each finding is coloured by its severity (error red, warning orange, info
grey, thin and faint), the detectors told apart by line style and named in a legend under
the plot; the short names written at the top are put in rows so that none lies on another
(one that would not fit in the rows is left to the legend). Steps where a curve is NaN or
Inf are shaded and hatched red on every panel: the curve itself has no point there.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from distdiag.analyze.core import AnalyzeConfig, pick_metric
from distdiag.analyze.series import Run, Series
from distdiag.report.figure import SEVERITY_COLOURS, PlotUnavailable, pyplot, save_figure
from distdiag.report.model import Report

__all__ = ["plot_report", "PlotUnavailable", "nonfinite_spans", "label_rows"]

_COLOURS = SEVERITY_COLOURS
_WIDTH = {"info": 0.7, "warning": 1.3, "error": 1.8, "critical": 2.0}
_ALPHA = {"info": 0.45, "warning": 0.9, "error": 1.0, "critical": 1.0}
_SPAN_ALPHA = {"info": 0.06, "warning": 0.14, "error": 0.18, "critical": 0.22}
_STYLES = [":", "--", "-.", (0, (1, 3)), (0, (5, 2, 1, 2)), (0, (8, 3))]
_LABEL_ROWS = 4
"""Rows of finding names at the top of the loss panel; a name that fits none is in the legend only."""
_ORDER = {"critical": 0, "error": 1, "warning": 2, "info": 3}


def nonfinite_spans(series: Series) -> list[tuple[int, int]]:
    """The (first, last) steps of each run of NaN/Inf values in `series`, the last step
    stretched to the next finite point's step (the region the curve has no value over)."""
    spans: list[tuple[int, int]] = []
    start = None
    for i, v in enumerate(series.values):
        finite = isinstance(v, int | float) and math.isfinite(v)
        if not finite and start is None:
            start = i
        elif finite and start is not None:
            spans.append((series.steps[start], series.steps[i]))
            start = None
    if start is not None:
        spans.append((series.steps[start], series.steps[-1]))
    return spans


def label_rows(items: list[tuple[float, float]], rows: int = _LABEL_ROWS) -> list[int | None]:
    """For labels given as (left, width) in axis fraction, the row each goes in so that no two
    in a row overlap (first fit, in the order given), or None when no row has room."""
    ends: list[float] = []
    out: list[int | None] = []
    for left, width in items:
        for row, end in enumerate(ends):
            if left >= end:
                ends[row] = left + width
                out.append(row)
                break
        else:
            if len(ends) < rows:
                ends.append(left + width)
                out.append(len(ends) - 1)
            else:
                out.append(None)
    return out


def _finite(values: list[float]) -> list[float]:
    """NaN where a value is not finite: matplotlib leaves a gap there (an Inf would stretch the axis)."""
    return [v if isinstance(v, int | float) and math.isfinite(v) else math.nan for v in values]


def _events(report: Report) -> list[tuple[str, dict[str, Any]]]:
    """(detector, event) of every finding with a step, worst severity first (drawn last, on top)."""
    out = [(probe.name, e) for probe in report.probes for e in probe.details.get("events", [])
           if isinstance(e, dict) and isinstance(e.get("step"), int | float)]
    return sorted(out, key=lambda pe: -_ORDER.get(pe[1].get("severity", "info"), 3))


def plot_report(runs: list[Run], report: Report, path: str | Path, config: AnalyzeConfig | None = None) -> Path:
    """Draw the runs' curves and the report's findings to `path` (.png, .svg, .pdf)."""
    plt = pyplot("--plot")
    fig, panels, curves = _curves(plt, runs, config or AnalyzeConfig())
    handles = _nonfinite(panels, curves) + _findings(fig, panels, report)
    panels[0].legend(loc="upper right", fontsize=8)
    panels[0].set_title(report.summary, fontsize=9, pad=8 + 10 * _LABEL_ROWS)
    if handles:
        fig.legend(handles=handles, loc="lower center", ncol=min(4, len(handles)), fontsize=8, frameon=False,
                   handlelength=4,
                   title="findings (colour: severity; line style: detector)", title_fontsize=8)
        fig.tight_layout(rect=(0, 0.05 + 0.025 * ((len(handles) - 1) // 4 + 1), 1, 1))
    else:
        fig.tight_layout()
    return save_figure(fig, path, "--plot")


def _curves(plt: Any, runs: list[Run], cfg: AnalyzeConfig) -> tuple[Any, list[Any], list[Series]]:
    """The figure, its panels (loss; gradient norm when a run has one) and the curves drawn."""
    grads = [(r, pick_metric(r, "grad", cfg.grad_metric)) for r in runs]
    has_grad = any(g is not None for _, g in grads)
    fig, axes = plt.subplots(2 if has_grad else 1, 1, figsize=(11, 8 if has_grad else 5.5), sharex=True, squeeze=False)
    panels = [row[0] for row in axes]
    curves: list[Series] = []
    for run in runs:
        for role, style in (("loss", "-"), ("val", "--")):
            s = pick_metric(run, role, cfg.metric if role == "loss" else cfg.val_metric)
            if s is not None:
                curves.append(s)
                label = f"{run.label}: {s.name}" if len(runs) > 1 else s.name
                panels[0].plot(s.steps, _finite(s.values), style, linewidth=0.9, label=label)
    panels[0].set_ylabel("loss")
    if has_grad:
        ax_g = panels[1]
        for run, g in grads:
            if g is not None:
                curves.append(g)
                ax_g.plot(g.steps, _finite(g.values), linewidth=0.9, label=f"{run.label}: {g.name}" if len(runs) > 1 else g.name)
        if any(v > 0 for _r, g in grads if g is not None for v in _finite(g.values)):
            ax_g.set_yscale("log")  # nan > 0 is False: only a finite positive norm asks for it
        ax_g.set_ylabel("gradient norm")
        ax_g.legend(loc="upper right", fontsize=8)
    panels[-1].set_xlabel("step")
    return fig, panels, curves


def _nonfinite(panels: list[Any], curves: list[Series]) -> list[Any]:
    """Hatch the steps where a curve is NaN/Inf on every panel; its legend entry, if any."""
    from matplotlib.patches import Patch

    spans = sorted({span for s in curves for span in nonfinite_spans(s)})
    for first, last in spans:
        for ax in panels:
            ax.axvspan(first, max(last, first + 0.5), facecolor=_COLOURS["error"], alpha=0.12, hatch="///",
                       edgecolor=_COLOURS["error"], linewidth=0)
    if not spans:
        return []
    return [Patch(facecolor=_COLOURS["error"], alpha=0.25, hatch="///", edgecolor=_COLOURS["error"],
                  label="NaN / Inf in a curve")]


def _findings(fig: Any, panels: list[Any], report: Report) -> list[Any]:
    """Mark each finding at its step (colour: severity, line style: detector); the legend
    entries, one per detector and severity."""
    from matplotlib.lines import Line2D

    handles: list[Any] = []
    styles: dict[str, Any] = {}
    seen: set[tuple[str, str]] = set()
    tops: list[tuple[float, str, str]] = []
    events = _events(report)
    several = len({e.get("run") for _n, e in events}) > 1  # name the run a mark is about
    for name, event in events:
        severity = event.get("severity", "info") if event.get("severity") in _COLOURS else "info"
        colour, style = _COLOURS[severity], styles.setdefault(name, _STYLES[len(styles) % len(_STYLES)])
        step, end = event["step"], event.get("end_step")
        for ax in panels:
            if end is not None and end != step:
                ax.axvspan(step, end, color=colour, alpha=_SPAN_ALPHA[severity], linewidth=0)
            ax.axvline(step, color=colour, linestyle=style, linewidth=_WIDTH[severity], alpha=_ALPHA[severity])
        if (name, severity) not in seen:
            seen.add((name, severity))
            handles.append(Line2D([], [], color=colour, linestyle=style, linewidth=_WIDTH[severity] + 0.4,
                                  label=f"{severity}: {name}"))
        if severity != "info":
            tops.append((float(step), f"{event.get('run')}: {name}" if several and event.get("run") else name, colour))
    _write_names(fig, panels[0], tops)
    return handles


def _write_names(fig: Any, ax: Any, tops: list[tuple[float, str, str]]) -> None:
    """The warnings' and errors' detector names above the loss panel, in rows that keep them apart."""
    lo, hi = ax.get_xlim()
    if hi <= lo or not tops:
        return
    width_in = fig.get_size_inches()[0] * 0.85
    tops = sorted({(step, name): (step, name, colour) for step, name, colour in tops}.values())
    items = []
    for step, name, _c in tops:
        x, width = (step - lo) / (hi - lo), (len(name) * 7 * 0.6 / 72 + 0.1) / width_in
        items.append((x - width if x + width > 1.0 else x, width))  # near the right edge: written leftwards
    order = sorted(range(len(items)), key=lambda i: items[i][0])
    rows = dict(zip(order, label_rows([items[i] for i in order]), strict=True))
    for i, (step, name, colour) in enumerate(tops):
        row = rows[i]
        if row is None:
            continue
        leftwards = items[i][0] < (step - lo) / (hi - lo)
        ax.annotate(name, (step, 1.0), xycoords=("data", "axes fraction"), xytext=(-2 if leftwards else 2, 3 + 10 * row),
                    textcoords="offset points", fontsize=7, color=colour, va="bottom",
                    ha="right" if leftwards else "left", annotation_clip=False)
