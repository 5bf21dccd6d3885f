"""`distdiag hang-report DIR`: render the watchdog's report, or analyse flight-recorder dumps.

DIR (or a file) holding hang-report.json is rendered as the watchdog printed it. Otherwise
every file in DIR (and in its subfolders: one folder per rank) is read as one rank's
flight-recorder dump (rank = its `rank` field, else the number ending its name, torch's
`<prefix><rank>` naming, host-prefixed or not, else its folder's): pickle (torch's default)
through an unpickler that loads plain data only, or JSON (distdiag/hang/dumps.py). Files
that are not dumps (a log, a README) are skipped, with one line on stderr naming them. The dumps become a report of the same form: groups by their
members, which rank stopped early on which group, where ranks recorded different
collectives at the same sequence (distdiag/hang/dumpreport.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from distdiag.cli.options import (
    ExitCodeOpt,
    ExitZeroOpt,
    FormatOpt,
    JunitOpt,
    check_format,
    check_image_path,
    check_junit_path,
    fail,
    write_junit_for,
)

if TYPE_CHECKING:
    from distdiag.report.model import Report

__all__ = ["register", "report_from_dumps", "dump_problem"]


def report_from_dumps(dumps: dict[int, dict[str, Any]], world_size: int | None = None,
                      others: dict[str, dict[int, dict[str, Any]]] | None = None) -> Report:
    """A Report from rank -> raw dump (distdiag.hang.dumpreport); raises ValueError."""
    from distdiag.hang.dumpreport import report_from_dumps as build

    return build(dumps, world_size, others)


def dump_problem(dump: object) -> str | None:
    """The first field of a dump whose type the analysis cannot use, or None."""
    from distdiag.hang.dumps import dump_problem as check

    return check(dump)


def _first_byte(path: Path) -> bytes:
    """The first byte of a file (b"" when it cannot be read): JSON report or recorder dump."""
    try:
        with path.open("rb") as handle:
            return handle.read(1)
    except OSError:
        return b""


def hang_report(
    paths: Annotated[list[Path], typer.Argument(
        metavar="PATH...", help="The watchdog's dump directory (or its hang-report.json), or flight-recorder dumps: "
        "a directory of them (subfolders per host or per rank are read too, other files skipped), or several "
        "directories or files (a shell glob such as dumps/nccl_trace_rank_*).")],
    format: FormatOpt = "text",
    trust_pickle: Annotated[
        bool, typer.Option("--trust-pickle", hidden=True, help="No longer needed: pickle dumps are read safely by default.")
    ] = False,
    exit_zero: ExitZeroOpt = False,
    exit_code: ExitCodeOpt = False,
    world_size: Annotated[
        int | None, typer.Option("--world-size", help="The job's number of ranks, when its dumps do not say (gloo's "
                                 "carry no membership): ranks without a dump are then suspects too.")
    ] = None,
    junit: JunitOpt = None,
    graph: Annotated[
        Path | None, typer.Option("--graph", metavar="FILE.dot|FILE.mmd|FILE.png", help="Also write the wait-for graph "
                                  "the verdict was drawn from: Graphviz DOT (.dot, .gv), Mermaid (.mmd), or an image "
                                  "(.png, .svg, .pdf; needs matplotlib: pip install 'distdiag[plot]').")
    ] = None,
) -> None:
    """Render a hang report the watchdog wrote, or one built from flight-recorder dumps.

    Several paths are read as one job's dumps (a report the watchdog wrote is one path alone)."""
    del exit_code, trust_pickle  # accepted for old scripts: the verdict's code is the default; pickles are read safely
    check_format(format)
    check_junit_path(junit)
    _check_graph_path(graph)
    report = _from_several(paths, world_size) if len(paths) > 1 else _from_one(paths[0], world_size)
    _show(report, format, exit_zero, junit, graph)


def _from_one(path: Path, world_size: int | None) -> Report:
    """The report the watchdog wrote (the file, or the folder holding it), else one built from
    the flight-recorder dumps the path holds."""
    from distdiag.errors import ReportError
    from distdiag.hang.dumpreport import dump_files, read_folder, skipped_line
    from distdiag.report.model import non_regular_kind, read_report
    from distdiag.watchdog.writer import REPORT_NAME

    if not path.exists():
        raise fail(f"{path} does not exist")
    if not path.is_dir() and not path.is_file():
        raise fail(f"{path} is {non_regular_kind(path)}: pass a report, a dump or a directory")
    target = path / REPORT_NAME if path.is_dir() else path
    if target.is_file() and (target.name == REPORT_NAME or path.is_file()) and _first_byte(target) == b"{":
        try:
            return read_report(target)
        except ReportError as exc:
            if target.name == REPORT_NAME:  # the watchdog's own file, broken: say so, not "no entries"
                raise fail(str(exc)) from None
    try:
        files = dump_files(path)
    except OSError as exc:
        raise fail(f"cannot list {path}: {exc.strerror}") from None
    if not files:
        raise fail(f"{path} holds no {REPORT_NAME} and no flight-recorder dumps")
    try:
        dumps, skipped, others = read_folder(files, path if path.is_dir() else None)
        if skipped:
            typer.echo(skipped_line(skipped, path), err=True)
        return report_from_dumps(dumps, world_size, others)
    except ValueError as exc:
        raise fail(str(exc)) from None
    except OSError as exc:
        raise fail(f"cannot read a dump in {path}: {exc.strerror}") from None


def _from_several(paths: list[Path], world_size: int | None) -> Report:
    """One job's dumps from several folders or files: every file each one holds, read as one set
    (a file named twice is read once)."""
    from distdiag.hang.dumpreport import dump_files, read_folder, skipped_line
    from distdiag.report.model import non_regular_kind
    from distdiag.watchdog.writer import REPORT_NAME

    roots: dict[Path, Path | None] = {}
    for path in paths:
        if not path.exists():
            raise fail(f"{path} does not exist")
        if not path.is_dir() and not path.is_file():
            raise fail(f"{path} is {non_regular_kind(path)}: pass dumps or directories of them")
        if path.name == REPORT_NAME or (path.is_dir() and (path / REPORT_NAME).is_file()):
            raise fail(f"{path} is (or holds) a report the watchdog wrote: pass it alone, not with other paths")
        try:
            listed = dump_files(path)
        except OSError as exc:
            raise fail(f"cannot list {path}: {exc.strerror}") from None
        for file in listed:
            roots.setdefault(file.resolve(), path.resolve() if path.is_dir() else None)
    if not roots:
        raise fail(f"{' '.join(map(str, paths[:3]))}{' ...' if len(paths) > 3 else ''} hold no flight-recorder dumps")
    try:
        dumps, skipped, others = read_folder(sorted(roots), roots=roots)
        if skipped:
            typer.echo(skipped_line(skipped, Path.cwd()), err=True)
        return report_from_dumps(dumps, world_size, others)
    except ValueError as exc:
        raise fail(str(exc)) from None
    except OSError as exc:
        raise fail(f"cannot read a dump: {exc.strerror}") from None


def _check_graph_path(graph: Path | None) -> None:
    """--graph must end .dot/.gv/.mmd (text) or .png/.svg/.pdf (an image, with matplotlib
    installed) and be a file to (re)write: bad input (exit 2) otherwise, before anything is read."""
    if graph is None:
        return
    from distdiag.hang.picture import graph_text
    from distdiag.report.figure import is_image_path
    from distdiag.report.safefile import RefusedFile, check_output_path

    if is_image_path(graph):
        check_image_path(graph, "--graph", needs="--graph FILE.png")
        return
    try:
        graph_text({"nodes": [], "edges": []}, str(graph))
        check_output_path(graph, "pass --graph a file path")
    except ValueError as exc:
        raise fail(str(exc)) from None
    except RefusedFile as exc:
        raise fail(f"--graph: {exc}") from None


def _write_graph(report: Report, graph: Path) -> None:
    """The wait-for graph of the report (its probe's `wait_for_graph`) as DOT, Mermaid or an
    image; a report without one (not a hang, or from an older distdiag) is said in one line."""
    from distdiag.hang.picture import graph_text
    from distdiag.report.figure import is_image_path
    from distdiag.report.model import write_json_atomic

    picture = next((p.details["wait_for_graph"] for p in report.probes
                    if isinstance(p.details.get("wait_for_graph"), dict)), None)
    if picture is None:
        typer.echo(f"distdiag: note: no wait-for graph in this report (not a hang, or written before distdiag drew "
                   f"one); {graph} not written", err=True)
        return
    try:
        if is_image_path(graph):
            from distdiag.hang.drawing import draw_picture

            written = draw_picture(picture, graph, title=getattr(report, "summary", ""))
        else:
            written = write_json_atomic(graph, graph_text(picture, str(graph)).rstrip("\n"))
    except OSError as exc:
        typer.echo(f"distdiag: cannot write the graph to {graph}: {exc.strerror or exc}", err=True)
        return
    typer.echo(f"distdiag: wait-for graph written to {written}", err=True)


def _show(report: Report, format: str, exit_zero: bool, junit: Path | None, graph: Path | None = None) -> None:
    """Print the report (JSON or text), write its JUnit XML and graph, exit with the verdict's code."""
    from distdiag.watchdog.writer import render_hang_report

    write_junit_for(report, junit, "hang-report")
    if graph is not None:
        _write_graph(report, graph)
    typer.echo(report.to_json() if format == "json" else render_hang_report(report, 0 if exit_zero else report.exit_code))
    raise typer.Exit(0 if exit_zero else report.exit_code)


def register(app: typer.Typer) -> None:
    app.command("hang-report")(hang_report)
