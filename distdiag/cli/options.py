"""Option aliases shared by the command groups (typer `Annotated` types)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Annotated, Any

import typer

from distdiag.errors import did_you_mean

__all__ = [
    "FormatOpt",
    "ExitZeroOpt",
    "ExitCodeOpt",
    "fail",
    "check_format",
    "check_severity",
    "did_you_mean",
    "raw_args",
    "register_passthrough",
]

FormatOpt = Annotated[
    str,
    typer.Option("--format", help="text: a human table; json: machine-readable on stdout.", metavar="[text|json]"),
]

ExitZeroOpt = Annotated[
    bool,
    typer.Option("--exit-zero", help="Exit 0 once the input was read, whatever the verdict (default: exit with the "
                 "verdict's code, so a CI step fails on a FAIL)."),
]
ExitCodeOpt = Annotated[
    bool,
    typer.Option("--exit-code", hidden=True, help="Deprecated, no effect: the exit code is the verdict's by default."),
]


def check_format(value: str) -> None:
    """--format must be text or json (one line and exit 2 otherwise)."""
    if value not in ("text", "json"):
        raise fail(f"--format must be text or json, got {value!r}")


def check_severity(value: str) -> None:
    """--min-severity must name a severity (one line and exit 2 otherwise)."""
    from distdiag.report.model import SEVERITIES

    if value not in SEVERITIES:
        raise fail(f"--min-severity must be one of {', '.join(SEVERITIES)}, got {value!r}")


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print one error line on stderr and return the Exit to raise (control characters from a
    file's content or name shown escaped: a terminal must not act on them)."""
    from distdiag.report.safefile import printable

    typer.echo(f"distdiag: error: {printable(message, one_line=True)}", err=True)
    return typer.Exit(code)


def raw_args(ctx: typer.Context, command: str) -> list[str]:
    """The arguments after `command` exactly as typed (a launcher command hands them on to its
    own parser or to torchrun untouched, `--` and all)."""
    argv = sys.argv[1:]
    if command in argv:
        return argv[argv.index(command) + 1 :]
    return list(ctx.args)  # called in-process (typer's test runner): the best we have


def register_passthrough(app: typer.Typer, name: str, command: Callable[..., Any]) -> None:
    """Register a command whose every argument, -h/--help included, goes to its own parser."""
    app.command(name, context_settings={"allow_extra_args": True, "ignore_unknown_options": True}, add_help_option=False)(command)
