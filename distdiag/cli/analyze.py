"""`distdiag analyze PATH...`: read metric logs, report divergence, NaN, spikes, plateaus, ..."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from distdiag.cli.options import (
    ExitCodeOpt,
    ExitZeroOpt,
    FormatOpt,
    JunitOpt,
    check_format,
    check_image_path,
    check_junit_path,
    check_severity,
    fail,
    write_junit_for,
)

if TYPE_CHECKING:
    from distdiag.analyze.core import AnalyzeConfig
    from distdiag.analyze.readers import Run
    from distdiag.report.model import Report

__all__ = ["register"]


def analyze(
    paths: Annotated[
        list[Path],
        typer.Argument(help="Logs, recognised by content: JSON lines (distdiag's or {\"step\",\"loss\"} lines), a Hugging Face trainer_state.json, CSV (Lightning's metrics.csv, W&B exports), TensorBoard event files, or their directories. Several: compared side by side."),
    ],
    format: FormatOpt = "text",
    plot: Annotated[Path | None, typer.Option("--plot", help="Write an image (.png, .svg, .pdf) of the curves: findings coloured by severity, NaN/Inf steps shaded (needs matplotlib: pip install 'distdiag[plot]').")] = None,
    metric: Annotated[str | None, typer.Option("--metric", help="The training-loss metric (default: loss, or the one named like it).")] = None,
    val_metric: Annotated[str | None, typer.Option("--val-metric", help="The validation-loss metric (default: one named like val/eval loss).")] = None,
    grad_metric: Annotated[str | None, typer.Option("--grad-metric", help="The gradient-norm metric (default: grad_norm, or one named like it).")] = None,
    spike_factor: Annotated[float, typer.Option("--spike-factor", help="A spike is >= this many times the recent median.")] = 2.0,
    tolerance: Annotated[float, typer.Option("--tolerance", help="Relative gap at which several runs part (0.05 = 5%).")] = 0.05,
    min_severity: Annotated[str, typer.Option("--min-severity", help="Hide findings below this: info, warning, error.")] = "info",
    strict: Annotated[bool, typer.Option("--strict", help="A truncated last line or record is an error too (default: skipped with a note).")] = False,
    exit_zero: ExitZeroOpt = False,
    exit_code: ExitCodeOpt = False,
    junit: JunitOpt = None,
) -> None:
    """Diagnose training curves from metric logs: divergence, NaN/Inf, loss spikes (and whether
    gradient spikes preceded them), plateaus, vanishing/exploding gradients, overfitting, and
    where several runs part."""
    from distdiag.analyze import AnalyzeConfig, LogFormatError, load_run
    from distdiag.analyze import analyze as run_analysis
    from distdiag.errors import ConfigError
    from distdiag.report.render import render_report

    del exit_code  # accepted for old scripts: the verdict's code is the default now
    check_format(format)
    check_severity(min_severity)
    if plot is not None:
        check_image_path(plot, "--plot")
    check_junit_path(junit)
    try:
        config = AnalyzeConfig(metric=metric, val_metric=val_metric, grad_metric=grad_metric, spike_factor=spike_factor, tolerance=tolerance)
        labels = _labels(paths)
        runs = [load_run(p, strict=strict, label=label) for p, label in zip(paths, labels, strict=True)]
        report = run_analysis(runs, config)
    except (LogFormatError, ConfigError) as exc:
        # the config's dotted keys are the CLI's flags: analyze.spike_factor -> --spike-factor
        raise fail(re.sub(r"analyze\.(\w+)", lambda m: "--" + m.group(1).replace("_", "-"), str(exc))) from None
    except OSError as exc:
        raise fail(f"cannot read {exc.filename}: {exc.strerror}") from None
    for run in runs:
        for note in run.notes:
            typer.echo(f"distdiag: note: {note}", err=True)
    if plot is not None:
        _write_plot(runs, report, plot, config)
    write_junit_for(report, junit, "analyze")
    if format == "json":
        typer.echo(report.to_json())
    else:
        # the title says what was read (render_report's own first line describes a check's ranks)
        sources = ", ".join(f"{r.label} ({r.source}, {max((len(s) for s in r.series.values()), default=0)} points)" for r in runs)
        typer.echo(
            render_report(
                report, min_severity=min_severity, title=f"distdiag analyze: {sources}",
                exit_code=0 if exit_zero else report.exit_code,
            )
        )
    raise typer.Exit(0 if exit_zero else report.exit_code)


def _write_plot(runs: list[Run], report: Report, plot: Path, config: AnalyzeConfig | None) -> None:
    """--plot: the curves with the findings marked, as an image (bad input: one line, exit 2)."""
    from distdiag.analyze.plot import PlotUnavailable, plot_report

    try:
        written = plot_report(runs, report, plot, config)
    except PlotUnavailable as exc:
        raise fail(str(exc)) from None
    except OSError as exc:
        raise fail(f"cannot write the plot: {exc}") from None
    typer.echo(f"distdiag: plot written to {written}", err=True)


def _labels(paths: list[Path]) -> list[str]:
    """Short names for the runs: the file stem, or the parent folder when stems collide."""
    stems = [_name(p) for p in paths]
    if len(set(stems)) == len(stems):
        return stems
    return [str(p) for p in paths]


def _name(p: Path) -> str:
    if not p.is_file():
        return p.name
    if p.name == "trainer_state.json":  # the Trainer's output dir names the run, not the file
        parent = p.parent.resolve()
        return parent.parent.name if parent.name.startswith("checkpoint-") else parent.name
    return p.stem


def register(app: typer.Typer) -> None:
    app.command("analyze")(analyze)
