"""`distdiag report show PATH`: render a saved report the way rank 0 printed it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from distdiag.cli.options import (
    ExitCodeOpt,
    ExitZeroOpt,
    FormatOpt,
    check_format,
    check_image_path,
    check_severity,
    fail,
)

__all__ = ["register"]

report_app = typer.Typer(help="Work with saved distdiag reports.", no_args_is_help=True)


@report_app.command("show")
def show(
    path: Annotated[Path, typer.Argument(help="A distdiag-report.json written by the check.")],
    format: FormatOpt = "text",
    min_severity: Annotated[
        str | None,
        typer.Option(
            "--min-severity",
            help="Hide findings below this: info, warning, error, critical (default: warning; info with --verbose).",
        ),
    ] = None,
    verbose: Annotated[
        bool,
        typer.Option(
            "--verbose", "-v",
            help="Also show info findings and every probe's tables, as the check's --verbose (default: tables only of probes with warnings or worse).",
        ),
    ] = False,
    full: Annotated[
        bool, typer.Option("--full", help="Everything: --verbose, and every row of the tables (default: the first 12).")
    ] = False,
    exit_zero: ExitZeroOpt = False,
    exit_code: ExitCodeOpt = False,
    chart: Annotated[
        Path | None, typer.Option("--chart", metavar="FILE.png", help="Also draw the bandwidth probe's results, as "
                                  "`distdiag gate --chart` does (.png, .svg, .pdf; needs matplotlib).")
    ] = None,
) -> None:
    """Render a saved report the way rank 0 printed it (--verbose, --full: more of it)."""
    from distdiag.errors import ReportError
    from distdiag.report.model import read_report
    from distdiag.report.render import render_report

    if min_severity is not None:
        check_severity(min_severity)
    del exit_code  # accepted for old scripts: the verdict's code is the default now
    check_format(format)
    if chart is not None:
        check_image_path(chart, "--chart")
    try:
        report = read_report(path)
    except ReportError as exc:
        raise fail(str(exc)) from None
    if chart is not None:
        from distdiag.cli.gate_chart import draw_from

        draw_from(str(path), str(chart), "distdiag")
    if format == "json":
        typer.echo(report.to_json())
    else:
        typer.echo(
            render_report(
                report, verbose=verbose or full, min_severity=min_severity, max_rows=None if full else 12,
                exit_code=0 if exit_zero else report.exit_code,
            )
        )
    raise typer.Exit(0 if exit_zero else report.exit_code)


def register(app: typer.Typer) -> None:
    app.add_typer(report_app, name="report")
