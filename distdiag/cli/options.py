"""Option aliases shared by the command groups (typer `Annotated` types)."""

from __future__ import annotations

from typing import Annotated

import typer

__all__ = ["FormatOpt", "fail", "check_format", "check_severity"]

FormatOpt = Annotated[
    str,
    typer.Option("--format", help="text: a human table; json: machine-readable on stdout.", metavar="[text|json]"),
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
