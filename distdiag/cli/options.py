"""Option aliases shared by the command groups (typer `Annotated` types)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from distdiag.errors import did_you_mean

if TYPE_CHECKING:
    from distdiag.report.model import Report

__all__ = [
    "FormatOpt",
    "ExitZeroOpt",
    "ExitCodeOpt",
    "JunitOpt",
    "check_junit_path",
    "write_junit_for",
    "fail",
    "check_format",
    "check_severity",
    "did_you_mean",
    "raw_args",
    "register_passthrough",
    "check_image_path",
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


JunitOpt = Annotated[
    Path | None,
    typer.Option("--junit", help="Also write the verdict as JUnit XML to PATH (as `distdiag check --junit`), "
                 "for CI systems that show test results.", metavar="PATH"),
]


def check_junit_path(path: Path | None) -> None:
    """--junit naming a link, FIFO or directory is bad input before anything is read (exit 2)."""
    if path is None:
        return
    from distdiag.report.safefile import RefusedFile, check_output_path

    try:
        check_output_path(path, "pass --junit a file path")
    except RefusedFile as exc:
        raise fail(f"--junit: {exc}") from None
    except OSError as exc:
        raise fail(f"--junit: cannot write {path}: {exc.strerror}") from None


def write_junit_for(report: Report, path: Path | str | None, command: str) -> None:
    """Write `report` as JUnit XML (suite `distdiag.<command>`) when --junit was given; a
    write that fails is said on stderr in one line and leaves the verdict's exit code alone,
    as `distdiag check --junit` does."""
    if path is None:
        return
    from distdiag.report.junit import write_junit

    try:
        write_junit(report, path, f"distdiag.{command}")
    except OSError as exc:
        typer.echo(f"distdiag: cannot write the JUnit XML to {path}: {exc.strerror or exc}", err=True)


def check_image_path(path: str | Path, option: str, needs: str | None = None) -> None:
    """An image output (`--plot`, `--chart`): a path ending .png/.svg/.pdf, not a link, FIFO or
    directory, and matplotlib installed (the `plot` extra); else one line and exit 2, before
    any input is read or any rank starts. `needs`: how the missing-matplotlib line names the
    option (default: `option`)."""
    from distdiag.report.figure import IMAGE_SUFFIXES, PlotUnavailable, is_image_path, pyplot
    from distdiag.report.safefile import RefusedFile, check_output_path

    try:
        check_output_path(path, f"pass {option} a file path")
    except RefusedFile as exc:
        raise fail(f"{option}: {exc}") from None
    if not is_image_path(path):
        raise fail(f"{option}: {path} must end in {', '.join(IMAGE_SUFFIXES)} (the image's format)")
    try:
        pyplot(needs or option)
    except PlotUnavailable as exc:
        raise fail(str(exc)) from None


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
