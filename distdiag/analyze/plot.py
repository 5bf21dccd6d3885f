"""`--plot PATH`: a PNG of the curves with the findings marked (matplotlib, an optional extra)."""

from __future__ import annotations

import io
from pathlib import Path

from distdiag.analyze.core import AnalyzeConfig, pick_metric
from distdiag.analyze.series import Run
from distdiag.errors import DistDiagError
from distdiag.report.model import Report
from distdiag.report.safefile import write_atomic

__all__ = ["plot_report", "PlotUnavailable"]

_COLOURS = {"info": "tab:gray", "warning": "tab:orange", "error": "tab:red", "critical": "darkred"}


class PlotUnavailable(DistDiagError):
    """matplotlib is not installed."""


def plot_report(runs: list[Run], report: Report, path: str | Path, config: AnalyzeConfig | None = None) -> Path:
    cfg = config or AnalyzeConfig()
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display: the CLI writes a file
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotUnavailable("--plot needs matplotlib: pip install 'distdiag[plot]'") from None
    grads = [(r, pick_metric(r, "grad", cfg.grad_metric)) for r in runs]
    has_grad = any(g is not None for _, g in grads)
    fig, axes = plt.subplots(2 if has_grad else 1, 1, figsize=(11, 7 if has_grad else 4.5), sharex=True, squeeze=False)
    ax_loss = axes[0][0]
    for run in runs:
        for role, style in (("loss", "-"), ("val", "--")):
            s = pick_metric(run, role, cfg.metric if role == "loss" else cfg.val_metric)
            if s is not None:
                label = f"{run.label}: {s.name}" if len(runs) > 1 else s.name
                ax_loss.plot(s.steps, s.values, style, linewidth=0.9, label=label)
    ax_loss.set_ylabel("loss")
    if has_grad:
        ax_g = axes[1][0]
        for run, g in grads:
            if g is not None:
                ax_g.plot(g.steps, g.values, linewidth=0.9, label=f"{run.label}: {g.name}" if len(runs) > 1 else g.name)
        ax_g.set_yscale("log")
        ax_g.set_ylabel("gradient norm")
        ax_g.legend(loc="upper right", fontsize=8)
    axes[-1][0].set_xlabel("step")
    for probe in report.probes:
        for event in probe.details.get("events", []):
            step = event.get("step")
            if step is None or event.get("severity") == "info" and probe.name != "plateau":
                continue
            colour = _COLOURS.get(event.get("severity", "info"), "tab:gray")
            end = event.get("end_step")
            for row in axes:
                if end is not None and end != step:
                    row[0].axvspan(step, end, color=colour, alpha=0.12)
                else:
                    row[0].axvline(step, color=colour, linestyle=":", linewidth=1.2)
            ax_loss.annotate(probe.name, (step, 1.0), xycoords=("data", "axes fraction"), rotation=90, fontsize=7, va="top", color=colour)
    ax_loss.legend(loc="upper right", fontsize=8)
    ax_loss.set_title(report.summary, fontsize=9)
    out = Path(path)
    fig.tight_layout()
    image = io.BytesIO()
    fig.savefig(image, dpi=110, format=out.suffix[1:].lower() or "png")
    plt.close(fig)
    # atomically, and never through a link planted at the path (distdiag/report/safefile.py)
    return write_atomic(out, image.getvalue(), "pass --plot a file path")
