"""`distdiag check [--nproc-per-node N] [options]`: launch the probe suite locally through torchrun.

The options are not declared here: typer only routes the command line to the parser every
rank uses (distdiag.check.options, with the launcher's own options added), so that
`distdiag check -h` and `python -m distdiag.check -h` list the same options with the same
meaning and cannot drift apart again.
"""

from __future__ import annotations

import typer

from distdiag.cli.options import fail, register_passthrough

__all__ = ["register"]


def check(ctx: typer.Context) -> None:
    """Run the probe suite on N local ranks through torchrun; exit with the verdict's code (see: distdiag check -h)."""
    from distdiag.check.config import layered_config
    from distdiag.check.options import build_parser, to_check_argv
    from distdiag.errors import ConfigError
    from distdiag.launcher.argv import launch_mode
    from distdiag.launcher.check import run_torchrun_check
    from distdiag.launcher.ranks import report_path_in, say_started

    # Bad input is one line and exit 2 before any rank starts: checked in full here for
    # --launch torchrun (before paying for N torch imports), or split with forkrun (below).
    merged = None
    try:
        args = build_parser(launcher=True).parse_args(ctx.args)
        launch = launch_mode(args.launch)
        if launch == "fork":
            # What needs no torch is checked here; the probe names and tables (they import
            # torch) by distdiag.launcher.forkrun, once, before it starts a rank.
            merged = layered_config(args)
        else:
            from distdiag.check.plan import config_from_args, make_plan, validate_injection

            merged = config_from_args(args)
            make_plan(merged, args.nproc_per_node)
            validate_injection(args.nproc_per_node)
    except ConfigError as exc:
        _leave_bad_input_report(str(exc), merged.report if merged is not None else report_path_in(ctx.args))
        raise fail(str(exc)) from None
    if launch != "fork":  # forkrun says it once the names it checks are known good
        say_started(merged, args.nproc_per_node)
    # The report the ranks write: the flag, else the config's or profile's, else the default.
    raise typer.Exit(run_torchrun_check(args.nproc_per_node, to_check_argv(args), merged.report, launch=launch))


def _leave_bad_input_report(message: str, path: str) -> None:
    """The report a script reads must say this run's bad input, not an earlier run's verdict
    (written where the check's report goes; when that path is the bad input, nothing is)."""
    from distdiag.launcher.launch import remove_stale_report
    from distdiag.launcher.ranks import write_bad_input_report

    remove_stale_report(path)
    write_bad_input_report(message, path, 1)


def register(app: typer.Typer) -> None:
    register_passthrough(app, "check", check)
