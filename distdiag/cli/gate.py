"""`distdiag gate [--chart FILE.png] [torchrun options] -- TRAINING COMMAND...`: the cluster gate, from the package.

A user who installed distdiag with pip has no launch/gate.sh; this is the same gate (and
launch/gate.sh now just runs it). Its arguments belong to torchrun and to the training
command, so they are taken as typed, from sys.argv: click would drop the `--` that separates
the two.

`--chart FILE` (before `--`, this command's own option) draws the bandwidth probe's results
(distdiag/report/bandwidth_chart.py) from this node's report once the check is over: here
when the gate stops the job, and, when it passes, in distdiag.cli.gate_chart just before it
becomes the training command (the gate execs the command, so nothing runs here after it).
"""

from __future__ import annotations

import os
import sys

import typer

from distdiag.cli.options import check_image_path, fail, raw_args, register_passthrough

__all__ = ["register", "split_chart", "CHART_HELP"]

CHART_HELP = """
--chart FILE (.png, .svg, .pdf; this command's own option, before `--`; needs matplotlib:
pip install 'distdiag[plot]'): also draw the bandwidth probe's results from this node's
report: each rank's straggler score, each ring link's GB/s and the busbw against its expected
floor, with the ranks and links the gate named in red and its limits as dashed lines. Drawn
whether the gate passes (just before the training command starts) or not."""


def split_chart(argv: list[str]) -> tuple[str | None, list[str]]:
    """(--chart's FILE or None, the arguments without it): only before `--` (after it, the
    training command's arguments). ValueError for a --chart without a FILE."""
    from distdiag.launcher.argv import take_option

    return take_option(argv, "--chart", "--chart needs a FILE (.png, .svg or .pdf) before `--`")


def gate(ctx: typer.Context) -> None:
    """Run the check on this node (torchrun options before --), then the training command if it passed (see: distdiag gate -h)."""
    from distdiag.launcher.argv import split_dashes
    from distdiag.launcher.gate import GATE_HELP, run_gate

    args = raw_args(ctx, "gate")
    if args[:1] in (["-h"], ["--help"]):
        typer.echo(GATE_HELP + "\n" + CHART_HELP)
        raise typer.Exit(0)
    try:
        chart, args = split_chart(args)
    except ValueError as exc:
        raise fail(str(exc)) from None
    if chart is None:
        raise typer.Exit(run_gate(args))
    check_image_path(chart, "--chart")
    # run_gate reads the same variable: set, it is the one report both sides name
    report = os.environ.get("DISTDIAG_REPORT") or "distdiag-gate-report.json"
    os.environ["DISTDIAG_REPORT"] = report
    try:
        before, command = split_dashes(args, "", command=True)
        args = [*before, "--", sys.executable, "-m", "distdiag.cli.gate_chart", report, chart, "--", *command]
    except ValueError:
        pass  # no training command: run_gate says the usage

    def draw(ours: str | None) -> None:
        # a report left by an earlier run is not this run's (its launch id is not ours): no chart of it
        if ours is not None:
            from distdiag.cli.gate_chart import draw_from

            draw_from(ours, chart)

    raise typer.Exit(run_gate(args, on_stop=draw))  # returns only when the job is not to start


def register(app: typer.Typer) -> None:
    register_passthrough(app, "gate", gate)
