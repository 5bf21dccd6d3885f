"""Text rendering of a report: the table rank 0 prints and `distdiag report show` repeats."""

from __future__ import annotations

import textwrap
from typing import Any

from distdiag.report import Finding, Report

__all__ = ["render_report", "format_ranks", "render_table"]

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


def render_report(
    report: Report,
    *,
    width: int = 100,
    min_severity: str = "info",
    max_rows: int | None = 12,
    title: str | None = None,
) -> str:
    """The consolidated verdict as text: one row per probe, findings under it, one verdict line.

    Probes' detail tables are cut at `max_rows` rows (None: all); the JSON report has them whole.
    `title` replaces the first line (which otherwise describes the ranks of a check).
    """
    from distdiag.report import SEVERITIES

    floor = SEVERITIES.index(min_severity)
    out: list[str] = []
    hosts = sorted({r.host for r in report.ranks})
    out.append(
        title
        or f"distdiag check: {report.world_size} rank(s) on {len(hosts) or 1} host(s)"
        + (f", restart {report.restart_count}" if report.restart_count else "")
    )
    name_w = max([len("probe")] + [len(p.name) for p in report.probes])
    out.append(f"{'probe'.ljust(name_w)}  status  time      findings")
    out.append(f"{'-' * name_w}  ------  --------  --------")
    for probe in report.probes:
        counts: dict[str, int] = {}
        for f in probe.findings:
            counts[f.severity] = counts.get(f.severity, 0) + 1
        summary = ", ".join(f"{n} {s}" for s, n in sorted(counts.items(), key=lambda kv: -SEVERITIES.index(kv[0])))
        if probe.status == "skip":
            summary = f"skipped: {probe.reason}"
        elif probe.status == "error" and probe.reason and not summary:
            summary = probe.reason
        out.append(
            f"{probe.name.ljust(name_w)}  {_MARK[probe.status]:<6}  {probe.duration_s:7.2f}s  "
            f"{summary or '-'}"
        )
        for f in probe.findings:
            if SEVERITIES.index(f.severity) >= floor:
                out += _finding_lines(f, report.world_size, width)
        for title, table in probe.details.items():
            if title.startswith("table:") and isinstance(table, list) and table and all(isinstance(r, dict) for r in table):
                out.append(f"  {title[6:]}:")
                shown = table if max_rows is None else table[:max_rows]
                out += ["    " + ln for ln in render_table(shown).splitlines()]
                if len(shown) < len(table):
                    out.append(
                        f"    ... {len(table) - len(shown)} more row(s): `distdiag report show --full` or the JSON report"
                    )
    if report.not_run:
        out.append(f"not run: {', '.join(report.not_run)} (the run ended early)")
    out.append("")
    out.append(f"verdict: {report.verdict.upper()} (exit {report.exit_code}) - {report.summary}")
    return "\n".join(out)
