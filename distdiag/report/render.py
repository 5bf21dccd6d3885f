"""Text rendering of a report: the table rank 0 prints and `distdiag report show` repeats."""

from __future__ import annotations

import os
import sys
import textwrap
from typing import Any, TextIO

from distdiag.report.model import SEVERITIES, Finding, ProbeResult, Report
from distdiag.report.safefile import printable

__all__ = ["render_report", "known_hosts", "format_ranks", "render_table", "ProgressLine", "PROGRESS_ENV"]

_MARK = {"pass": "PASS", "warn": "WARN", "fail": "FAIL", "skip": "SKIP", "error": "ERROR"}
_SEV = {"info": "info", "warning": "WARN", "error": "ERROR", "critical": "CRIT"}


def format_ranks(ranks: list[int], world_size: int | None = None) -> str:
    """[0,1,2,5] -> 'ranks 0-2,5'; every rank -> 'all ranks'."""
    if not ranks:
        return "job"
    if world_size and len(ranks) == world_size and world_size > 1:
        return "all ranks"
    spans: list[str] = []
    start = prev = ranks[0]
    for r in ranks[1:] + [None]:  # type: ignore[list-item]
        if r is not None and r == prev + 1:
            prev = r
            continue
        spans.append(f"{start}" if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(spans)


def render_table(rows: list[dict[str, Any]], columns: list[str] | None = None) -> str:
    """A plain fixed-width table of dict rows (used for probes' structured details)."""
    if not rows:
        return "(empty)"
    cols = columns or list(rows[0].keys())
    cells = [[str(row.get(c, "")) for c in cols] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(cols)]
    line = "  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(out)


def _finding_lines(f: Finding, world_size: int, width: int) -> list[str]:
    head = f"  [{_SEV[f.severity]}] {format_ranks(f.ranks, world_size)}: {f.issue}"
    lines = textwrap.wrap(head, width, subsequent_indent="      ") or [head]
    if f.evidence:
        for part in f.evidence.splitlines():
            lines += textwrap.wrap(
                part, width, initial_indent="      evidence: ", subsequent_indent="        "
            ) or []
            break
        extra = f.evidence.splitlines()[1:]
        lines += [f"        {x}" for x in extra[:30]]
        if len(extra) > 30:
            lines.append(f"        ... ({len(extra) - 30} more lines in the JSON report)")
    if f.fix:
        lines += textwrap.wrap(
            f.fix, width, initial_indent="      fix: ", subsequent_indent="        "
        )
    if f.drain:
        where = ", ".join(f"{k}={v}" for k, v in f.drain.items())
        lines.append(f"      DRAIN: take this node out ({where})")
    return lines


def _probe_row(probe: ProbeResult, name_w: int) -> str:
    """A probe's row of the table: name, status, time, and its findings counted by severity."""
    counts: dict[str, int] = {}
    for f in probe.findings:
        counts[f.severity] = counts.get(f.severity, 0) + 1
    summary = ", ".join(f"{n} {s}" for s, n in sorted(counts.items(), key=lambda kv: -SEVERITIES.index(kv[0])))
    if probe.status == "skip":
        summary = f"skipped: {probe.reason}"
    elif probe.status == "error" and probe.reason and not summary:
        summary = probe.reason
    return f"{probe.name.ljust(name_w)}  {_MARK[probe.status]:<6}  {probe.duration_s:7.2f}s  {summary or '-'}"


def _detail_tables(probe: ProbeResult, max_rows: int | None) -> list[str]:
    """A probe's `table:` details, each cut at `max_rows` rows with a line saying how many more."""
    out: list[str] = []
    for name, table in probe.details.items():
        if name.startswith("table:") and isinstance(table, list) and table and all(isinstance(r, dict) for r in table):
            out.append(f"  {name[6:]}:")
            shown = table if max_rows is None else table[:max_rows]
            out += ["    " + ln for ln in render_table(shown).splitlines()]
            if len(shown) < len(table):
                out.append(
                    f"    ... {len(table) - len(shown)} more row(s): `distdiag report show --full` or the JSON report"
                )
    return out


def known_hosts(report: Report) -> list[str]:
    """The hosts the rank table names; a rank nobody could place ('?': lost before it checked
    in, on a host nobody knows) is not a host of its own."""
    return sorted({r.host for r in report.ranks if r.host not in ("", "?")})


def render_report(
    report: Report,
    *,
    width: int = 100,
    verbose: bool = True,
    min_severity: str | None = None,
    max_rows: int | None = 12,
    title: str | None = None,
    exit_code: int | None = None,
) -> str:
    """The consolidated verdict as text: one row per probe, findings under it, one verdict line.

    `verbose=False` is the check's default: info findings are left out and a probe's detail
    tables are shown only when it has a warning or worse, so a healthy run is one line per
    probe and the verdict. `verbose=True` shows every finding and table. `min_severity`
    overrides the floor either way (default: info when verbose, else warning). Tables are
    cut at `max_rows` rows (None: all); the JSON report always has everything.
    `title` replaces the first line (which otherwise describes the ranks of a check).
    `exit_code` is the code the command will return when it is not the report's own (a
    command that exits 0 unless asked for `--exit-code`): the verdict line prints that one and
    says which flag returns the report's, so a printed exit code is always the one returned.
    """
    floor = SEVERITIES.index(min_severity or ("info" if verbose else "warning"))
    # every string here may come from a file (`report show`, `hang-report`, analyze's logs):
    # escaped before wrapping and splitting (which would act on a CR or a C1 line break)
    report = Report.from_dict(_printable_tree(report.to_dict()))
    out: list[str] = []
    hosts = known_hosts(report)
    out.append(
        title
        or f"distdiag check: {report.world_size} rank(s) on {len(hosts) or 1} host(s)"
        + (f", restart {report.restart_count}" if report.restart_count else "")
    )
    name_w = max([len("probe")] + [len(p.name) for p in report.probes])
    out.append(f"{'probe'.ljust(name_w)}  status  time      findings")
    out.append(f"{'-' * name_w}  ------  --------  --------")
    for probe in report.probes:
        out.append(_probe_row(probe, name_w))
        for f in probe.findings:
            if SEVERITIES.index(f.severity) >= floor:
                out += _finding_lines(f, report.world_size, width)
        troubled = probe.status in ("warn", "fail", "error") or any(f.severity != "info" for f in probe.findings)
        if verbose or troubled:
            out += _detail_tables(probe, max_rows)
    if report.not_run:
        out.append(f"not run: {', '.join(report.not_run)} (the run ended early)")
    out.append("")
    code = f"exit {report.exit_code}"
    if exit_code is not None and exit_code != report.exit_code:
        code = f"exit {exit_code}; --exit-code exits {report.exit_code}"
    out.append(f"verdict: {report.verdict.upper()} ({code}) - {report.summary}")
    return printable("\n".join(out))  # the title too


def _printable_tree(value: Any) -> Any:
    """A report's dict with every string (keys too) passed through safefile.printable."""
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, dict):
        return {_printable_tree(k): _printable_tree(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_printable_tree(v) for v in value]
    return value


PROGRESS_ENV = "DISTDIAG_PROGRESS"
"""Set to `stdout` by `distdiag check` when its own stdout and stderr are a terminal: the
ranks' stderr is then a pipe to the launcher, so rank 0 draws its progress line on stdout."""


def _is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # replaced or closed streams
        return False


class ProgressLine:
    """Which probe rank 0 is running, as one status line rewritten in place with `\\r`.

    Only on a terminal (stdout and stderr both a TTY, or the launcher's terminal through
    PROGRESS_ENV), with text output that is not --quiet, on rank 0; otherwise every call is a
    no-op. The line ends with `\\r`, so any other output (another rank's warning) writes over
    it instead of after it; `clear()` blanks it before the verdict is printed.
    """

    def __init__(self, stream: TextIO | None) -> None:
        self.stream = stream
        self.width = 0

    @classmethod
    def for_check(cls, config: Any, rank: int) -> ProgressLine:
        if rank != 0 or config.format != "text" or config.quiet:
            return cls(None)
        if _is_tty(sys.stdout) and _is_tty(sys.stderr):
            return cls(sys.stderr)
        if os.environ.get(PROGRESS_ENV) == "stdout" and _is_tty(sys.stdout):
            return cls(sys.stdout)
        return cls(None)

    def show(self, index: int, total: int, name: str) -> None:
        if self.stream is None:
            return
        text = f"distdiag [{index + 1}/{total}] {name} ..."
        self._write("\r" + text.ljust(self.width) + "\r")
        self.width = len(text)

    def clear(self) -> None:
        """Blank the line for good: nothing is shown after the verdict."""
        if self.stream is not None and self.width:
            self._write("\r" + " " * self.width + "\r")
        self.stream = None
        self.width = 0

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)  # type: ignore[union-attr]
            self.stream.flush()  # type: ignore[union-attr]
        except (OSError, ValueError):  # the terminal went away: drop the line, never the check
            self.stream = None
