"""Option aliases shared by the command groups (typer `Annotated` types)."""

from __future__ import annotations

from typing import Annotated

import typer

__all__ = ["FormatOpt", "fail"]

FormatOpt = Annotated[
    str,
    typer.Option("--format", help="text: a human table; json: machine-readable on stdout.", case_sensitive=False),
]


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print one error line on stderr and return the Exit to raise."""
    typer.echo(f"distdiag: error: {message}", err=True)
    return typer.Exit(code)
