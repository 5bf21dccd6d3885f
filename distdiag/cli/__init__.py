"""The `distdiag` command (typer): one module per command group, registered here.

Results go to stdout, hints and errors to stderr; a user mistake is one line and exit 2;
a traceback only with DISTDIAG_DEBUG=1. Modules: check, gate, probes, report, analyze,
hang_report, watch (one per command group), options (the option types they share) and
gate_chart (the step `gate --chart` runs before the training command). The top of
the house: it may import any distdiag package, but only inside the command that needs it,
so `distdiag --help` does not import torch.
"""

from __future__ import annotations

import os
import sys
from typing import Annotated

import typer

from distdiag.cli import analyze as _analyze
from distdiag.cli import check as _check
from distdiag.cli import gate as _gate
from distdiag.cli import hang_report as _hang_report
from distdiag.cli import probes as _probes
from distdiag.cli import report as _report
from distdiag.cli import watch as _watch

__all__ = ["app", "main"]

app = typer.Typer(
    name="distdiag",
    help="Diagnostics for distributed PyTorch training: probe suite, hang watchdog, cluster gate.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _print_version(value: bool) -> None:
    if value:
        from distdiag.check.options import version_line

        typer.echo(version_line())
        raise typer.Exit(0)


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", help="Print distdiag's version and exit.", is_eager=True, callback=_print_version)
    ] = False,
) -> None:
    """Diagnostics for distributed PyTorch training: probe suite, hang watchdog, cluster gate."""


_check.register(app)
_gate.register(app)
_probes.register(app)
_report.register(app)
_analyze.register(app)
_hang_report.register(app)
_watch.register(app)


def _click_class(name: str) -> type[BaseException]:
    """A class of the click that typer runs on (typer >= 0.2x vendors its own copy, so
    `import click` may be another click or none): found through typer's public BadParameter."""
    return next(k for k in typer.BadParameter.__mro__ if k.__name__ == name)


def main() -> None:
    """Console entry point: user errors become one line on stderr and exit code 2.

    click would print a usage block (three lines, or a box with rich) for an unknown option or
    a bad choice; run it non-standalone and print its message as one line instead.
    """
    from distdiag.errors import DistDiagError

    debug = os.environ.get("DISTDIAG_DEBUG") == "1"
    click_error, usage_error = _click_class("ClickException"), _click_class("UsageError")
    try:
        code = app(standalone_mode=False)
    except typer.Abort:
        print("distdiag: aborted", file=sys.stderr)
        sys.exit(130)
    except click_error as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":  # bare `distdiag`: the help, as always
            exc.show()  # type: ignore[attr-defined]
            sys.exit(exc.exit_code)  # type: ignore[attr-defined]
        if debug:
            raise
        ctx = getattr(exc, "ctx", None) if isinstance(exc, usage_error) else None
        where = f" (see: {ctx.command_path} -h)" if ctx is not None else ""
        print(f"distdiag: error: {exc.format_message()}{where}", file=sys.stderr)  # type: ignore[attr-defined]
        sys.exit(exc.exit_code)  # type: ignore[attr-defined]
    except DistDiagError as exc:
        if debug:
            raise
        from distdiag.report.safefile import printable

        print(f"distdiag: error: {printable(str(exc), one_line=True)}", file=sys.stderr)
        sys.exit(2)
    sys.exit(code if isinstance(code, int) else 0)
