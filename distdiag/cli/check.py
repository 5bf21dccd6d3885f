"""`distdiag check --nproc N [options]`: launch the probe suite locally through torchrun."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from distdiag.cli.options import fail

__all__ = ["register"]


def check(
    nproc: Annotated[int, typer.Option("--nproc", help="Ranks to start on this machine (torchrun --nproc-per-node).")] = 2,
    probes: Annotated[str | None, typer.Option("--probes", help="Probes to run, comma-separated (default: every probe that applies).")] = None,
    skip: Annotated[str | None, typer.Option("--skip", help="Probes to leave out, comma-separated.")] = None,
    profile: Annotated[str | None, typer.Option("--profile", help="A profile shipped with distdiag (default, quick, full, ...).")] = None,
    config: Annotated[Path | None, typer.Option("--config", help="A TOML config file; flags override it.")] = None,
    report: Annotated[str | None, typer.Option("--report", help="Where the JSON report goes (default: the config's, else distdiag-report.json).")] = None,
    timeout_s: Annotated[float | None, typer.Option("--timeout-s", help="Deadline of one probe, seconds (default 60).")] = None,
    deadline_s: Annotated[float | None, typer.Option("--deadline-s", help="Deadline of the whole check, seconds (default 600).")] = None,
    format: Annotated[str | None, typer.Option("--format", help="text (a table) or json (the report on stdout).")] = None,
    junit: Annotated[str | None, typer.Option("--junit", help="Also write the verdict as JUnit XML here.")] = None,
    quiet: Annotated[bool, typer.Option("--quiet", help="Print only the verdict line.")] = False,
    target: Annotated[str | None, typer.Option("--target", help="Your target: a module name or a .py file with hook functions.")] = None,
) -> None:
    """Run the probe suite on NPROC local ranks; exit with the verdict's code.

    Exit codes: 0 pass (warnings allowed), 1 a probe failed, 2 bad input, 3 a rank hung,
    died or never reported, 4 take a node out.
    """
    from distdiag.errors import ConfigError
    from distdiag.launcher import run_torchrun_check
    from distdiag.plan import make_plan, parse_config

    if nproc < 1:
        raise fail(f"--nproc must be >= 1, got {nproc}")
    args: list[str] = []
    for flag, value in (
        ("--report", report), ("--probes", probes), ("--skip", skip), ("--profile", profile), ("--config", config),
        ("--timeout-s", timeout_s), ("--deadline-s", deadline_s), ("--format", format), ("--target", target),
        ("--junit", junit),
    ):
        if value is not None:
            args += [flag, str(value)]
    if quiet:
        args.append("--quiet")
    try:  # the same validation every rank does, before paying for N torch imports
        merged = parse_config(args)
        make_plan(merged, nproc)
    except ConfigError as exc:
        raise fail(str(exc)) from None
    # The report the ranks write: the flag, else the config's or profile's, else the default.
    raise typer.Exit(run_torchrun_check(nproc, args, merged.report))


def register(app: typer.Typer) -> None:
    app.command("check")(check)
