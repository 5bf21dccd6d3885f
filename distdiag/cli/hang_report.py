"""`distdiag hang-report DIR`: render the watchdog's report, or analyse flight-recorder dumps.

DIR (or a file) holding hang-report.json is rendered as the watchdog printed it. Otherwise
every file in DIR is read as one rank's flight-recorder dump (rank = the trailing digits of
its name, torch's `<prefix><rank>` naming): JSON as it is, pickle only with --trust-pickle
(unpickling runs code). The dumps become a report of the same form: which rank stopped
early on which group, and where ranks recorded different collectives at the same sequence.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any

import typer

from distdiag.cli.options import FormatOpt, check_format, fail

__all__ = ["register", "report_from_dumps", "dump_problem"]


def _rank_of(path: Path, fallback: int) -> int:
    match = re.search(r"(\d+)(?:\.\w+)?$", path.name)
    return int(match.group(1)) if match else fallback


def dump_problem(dump: Any) -> str | None:
    """The first field of a recorder dump whose type report_from_dumps cannot use, or None.

    Only what is read is checked: `entries` a list of objects, each with an integer (or null)
    sequence id, a list `process_group`, a string `profiling_name`, a boolean `is_p2p`.
    """
    from distdiag.report.schema import MAX_DEPTH, json_depth

    if not isinstance(dump, dict):
        return f"the dump is a {type(dump).__name__}, not an object"
    if json_depth(dump) > MAX_DEPTH:
        return f"it nests deeper than {MAX_DEPTH} levels"
    entries = dump.get("entries")
    if entries is None:
        return None
    if not isinstance(entries, list):
        return f"'entries' must be a list, got {type(entries).__name__}"
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            return f"entries[{i}] must be an object, got {type(entry).__name__}"
        for key in ("collective_seq_id", "p2p_seq_id"):
            value = entry.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                return f"entries[{i}].{key} must be an integer, got {value!r}"
        group = entry.get("process_group")
        if group is not None and (not isinstance(group, list) or not group):
            return f"entries[{i}].process_group must be a non-empty list, got {group!r}"
        if not isinstance(entry.get("profiling_name", ""), str):
            return f"entries[{i}].profiling_name must be a string"
        if not isinstance(entry.get("is_p2p", False), bool):
            return f"entries[{i}].is_p2p must be true or false"
    return None


def report_from_dumps(dumps: dict[int, dict[str, Any]]) -> Any:
    """A Report (probe 'flight_recorder') from per-rank recorder dumps.

    Each dump becomes that rank's engine view (distdiag.hang.recorder.positions_from_dump: what it
    enqueued, started and completed per group, and its entries), and the hang rules that
    read live snapshots read these: who never entered the collective the others are in, a
    desync in the entries, a stall (NCCL: started everywhere, completed nowhere).
    Raises ValueError for a file that is not a dump.
    """
    from distdiag.hang import analyze_hang, snapshot_details
    from distdiag.hang.recorder import positions_from_dump
    from distdiag.report.model import EXIT_HANG, EXIT_PASS, Finding, ProbeResult, Report, verdict_for
    from distdiag.report.render import format_ranks

    world = max(dumps) + 1 if dumps else 0
    snaps = {
        rank: {"phase": "training", "probe": "the dumped job", "stack": [], "recent": [],
               "engine": positions_from_dump(dump), "in_collective": None}
        for rank, dump in sorted(dumps.items())
    }
    lost = {r: "no dump file for this rank" for r in range(world) if r not in dumps}
    findings = [f for f in analyze_hang(snaps, lost, {}, world, what="the dumped job", timeout_s=0)
                if "did not finish within" not in f.issue]
    guessed = any(g.get("completion_unknown") for s in snaps.values() for g in s["engine"]["groups"])
    note = ("gloo dumps record no completion: each rank's last recorded collective is taken as the one it is in"
            if guessed else "positions from each dump's pg_status (enqueued / started / completed per group)")
    findings.append(Finding(severity="info", issue=f"read flight-recorder dumps of {format_ranks(sorted(dumps))}", evidence=note))
    details = snapshot_details(snaps)
    details.pop("stacks", None)
    details.pop("recent_collectives", None)
    result = ProbeResult.from_findings("flight_recorder", findings, details=details)
    code = EXIT_HANG if any(f.severity == "critical" for f in findings) else EXIT_PASS
    return Report(
        world_size=world, probes=[result], exit_code=code, verdict=verdict_for(code, [result]),
        outcome="hang" if code else "completed", summary=findings[0].issue,
    )


def hang_report(
    path: Annotated[Path, typer.Argument(help="The watchdog's dump directory (or its hang-report.json), or a directory of flight-recorder dumps.")],
    format: FormatOpt = "text",
    trust_pickle: Annotated[
        bool, typer.Option("--trust-pickle", help="Read pickle flight-recorder dumps (unpickling runs code from the file).")
    ] = False,
    exit_code: Annotated[bool, typer.Option("--exit-code", help="Exit 3 when the report says the job hung.")] = False,
) -> None:
    """Render a hang report the watchdog wrote, or one built from flight-recorder dumps."""
    from distdiag.errors import ReportError
    from distdiag.report.model import non_regular_kind, read_report
    from distdiag.watchdog.flight import load_dump
    from distdiag.watchdog.writer import REPORT_NAME, render_hang_report

    check_format(format)
    if not path.exists():
        raise fail(f"{path} does not exist")
    if not path.is_dir() and not path.is_file():
        raise fail(f"{path} is {non_regular_kind(path)}: pass a report, a dump or a directory")
    target = path / REPORT_NAME if path.is_dir() else path
    if target.is_file() and (target.name == REPORT_NAME or path.is_file()) and target.read_bytes()[:1] == b"{":
        try:
            report = read_report(target)
        except ReportError as exc:
            if target.name == REPORT_NAME:  # the watchdog's own file, broken: say so, not "no entries"
                raise fail(str(exc)) from None
            report = None
        if report is not None:
            typer.echo(report.to_json() if format == "json" else render_hang_report(report, report.exit_code if exit_code else 0))
            if exit_code:
                raise typer.Exit(report.exit_code)
            return
    files = sorted(p for p in ([path] if path.is_file() else path.iterdir()) if p.is_file() and not p.name.startswith("."))
    if not files:
        raise fail(f"{path} holds no {REPORT_NAME} and no flight-recorder dumps")
    dumps: dict[int, dict[str, Any]] = {}
    for i, file in enumerate(files):
        try:
            dump = load_dump(file, trust_pickle=trust_pickle)
        except ValueError as exc:
            raise fail(str(exc)) from None
        except RecursionError:
            raise fail(f"{file} nests JSON too deeply to read: not a flight-recorder dump") from None
        except OSError as exc:
            raise fail(f"cannot read {file}: {exc.strerror}") from None
        problem = dump_problem(dump)
        if problem:
            raise fail(f"{file} is not a flight-recorder dump: {problem}")
        dumps[_rank_of(file, i)] = dump
    try:
        report = report_from_dumps(dumps)
    except ValueError as exc:
        raise fail(str(exc)) from None
    typer.echo(report.to_json() if format == "json" else render_hang_report(report, report.exit_code if exit_code else 0))
    if exit_code:
        raise typer.Exit(report.exit_code)


def register(app: typer.Typer) -> None:
    app.command("hang-report")(hang_report)
