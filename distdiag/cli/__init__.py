"""The `distdiag` command (typer): one module per command group, registered here.

Results go to stdout, hints and errors to stderr; a user mistake is one line and exit 2;
a traceback only with DISTDIAG_DEBUG=1.
"""

from __future__ import annotations

import os
import sys

import typer

from distdiag.cli import analyze as _analyze
from distdiag.cli import check as _check
from distdiag.cli import hang_report as _hang_report
from distdiag.cli import probes as _probes
from distdiag.cli import report as _report

__all__ = ["app", "main"]

app = typer.Typer(
    name="distdiag",
    help="Diagnostics for distributed PyTorch training: probe suite, hang watchdog, cluster gate.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
_check.register(app)
_probes.register(app)
_report.register(app)
_analyze.register(app)
_hang_report.register(app)


def main() -> None:
    """Console entry point: user errors become one line on stderr and exit code 2."""
    from distdiag.errors import DistDiagError

    try:
        app()
    except DistDiagError as exc:
        if os.environ.get("DISTDIAG_DEBUG") == "1":
            raise
        print(f"distdiag: error: {exc}", file=sys.stderr)
        sys.exit(2)
