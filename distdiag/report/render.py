"""Text rendering of a report: the table rank 0 prints and `distdiag report show` repeats."""

from __future__ import annotations

import os
import re
import shutil
import sys
import textwrap
from collections.abc import Iterable
from typing import Any, TextIO

from distdiag.report.hostlist import slurm_hostlist
from distdiag.report.model import SEVERITIES, Finding, ProbeResult, Report
from distdiag.report.safefile import printable

__all__ = [
    "render_report", "known_hosts", "format_ranks", "compress_numbers", "format_hosts", "slurm_hostlist",
    "hosts_text", "render_table", "ProgressLine",
    "PROGRESS_ENV", "PlainBeat", "BEAT_S", "is_beat_line", "runner_frame", "without_runner_frames", "terminal_width",
]

_MARK = {"pass": "PASS", "warn": "WARN", "fail": "FAIL", "skip": "SKIP", "error": "ERROR"}
_SEV = {"info": "info", "warning": "WARN", "error": "ERROR", "critical": "CRIT"}


def format_ranks(ranks: list[int], world_size: int | None = None) -> str:
    """[0,1,2,5] -> 'ranks 0-2,5'; every rank -> 'all ranks'; long regular sets compressed
    (`compress_numbers`): [7,15,...,16383] -> 'ranks 7-16383 step 8'."""
    if not ranks:
        return "job"
    if world_size and len(ranks) == world_size and world_size > 1:
        return "all ranks"
    return ("rank " if len(ranks) == 1 else "ranks ") + compress_numbers(ranks)


MIN_REPEATS = 4
"""A pattern is written as a repeat only from this many repeats on: 'ranks 1,3,5' stays as is."""
MAX_PARTS = 12
"""Parts of a compressed set shown before the rest is cut to '...,LAST (N in all)'."""


def _spans(nums: list[int]) -> list[tuple[int, int]]:
    """Sorted numbers as runs of consecutive ones: [0,1,2,5] -> [(0,2), (5,5)]."""
    out: list[tuple[int, int]] = []
    for n in nums:
        if out and n == out[-1][1] + 1:
            out[-1] = (out[-1][0], n)
        elif not out or n > out[-1][1]:
            out.append((n, n))
    return out


def _span_text(a: int, b: int, width: int = 0) -> str:
    return f"{a:0{width}d}" if a == b else f"{a:0{width}d}-{b:0{width}d}"


def _repeat_at(spans: list[tuple[int, int]], i: int, max_block: int = 16) -> tuple[int, int, int] | None:
    """(block length, repeats, offset) of the longest run of a block of spans repeated at a fixed
    offset from spans[i] on (the same TP slots in every replica), or None."""
    best: tuple[int, int, int] | None = None
    for p in range(1, min(max_block, (len(spans) - i) // MIN_REPEATS) + 1):
        if best is not None and best[0] * best[1] == len(spans) - i:
            break  # it covers every span left: no longer block can do better (a stride set: 16x less work)
        off = spans[i + p][0] - spans[i][0]
        r = 1
        while i + (r + 1) * p <= len(spans) and all(
                spans[i + r * p + j] == (spans[i + j][0] + r * off, spans[i + j][1] + r * off) for j in range(p)):
            r += 1
        if r >= MIN_REPEATS and (best is None or r * p > best[0] * best[1]):
            best = (p, r, off)
    return best


def compress_numbers(nums: Iterable[int], width: int = 0, *, cut: bool = True) -> str:
    """Numbers (ranks, host indices) as short text: runs '0-2', strides '7-16383 step 8',
    repeated blocks '[32-34,36-39] every 32 to 16359' (one TP group's ranks in every DP
    replica), and past MAX_PARTS parts '...,LAST (N in all)' (`cut` False: every part, the
    text names exactly the numbers). Linear in the numbers.
    `width`: numbers zero-padded to it (host numbers); steps and counts are not."""
    spans = _spans(sorted(nums))
    parts: list[str] = []
    i = 0
    while i < len(spans):
        found = _repeat_at(spans, i)
        if found is None:
            parts.append(_span_text(*spans[i], width))
            i += 1
            continue
        p, r, off = found
        last = spans[i + r * p - 1]
        if p == 1 and spans[i][0] == spans[i][1]:
            parts.append(f"{_span_text(spans[i][0], last[1], width)} step {off}")
        else:
            parts.append("[" + ",".join(_span_text(*s, width) for s in spans[i:i + p])
                         + f"] every {off} to {last[1]:0{width}d}")
        i += r * p
    if cut and len(parts) > MAX_PARTS:
        count = sum(b - a + 1 for a, b in spans)
        parts = [*parts[:MAX_PARTS - 1], f"...,{_span_text(*spans[-1], width)} ({count} in all)"]
    return ",".join(parts)


def format_hosts(hosts: list[str]) -> str:
    """Host names with a common stem compressed: node0004..node0007, node0009 -> 'node[0004-0007,0009]'."""
    stems: dict[tuple[str, int], list[int]] = {}
    plain: list[str] = []
    for h in sorted(set(hosts)):
        m = _HOST_NUM.match(h)
        if m is None:
            plain.append(h)
        else:
            stems.setdefault((m.group(1), len(m.group(2))), []).append(int(m.group(2)))
    out = list(plain)
    for (stem, width), nums in stems.items():
        if len(nums) == 1:
            out.append(f"{stem}{nums[0]:0{width}d}")
            continue
        text = compress_numbers(nums, width)
        if "[" not in text:
            out.append(f"{stem}[{text}]")
        else:  # a repeated block: 'node[0005-0007] every 4 to 0127', or in parentheses with more
            out.append(f"{stem}{text}" if text.count("[") == 1 and text.startswith("[") and "," not in text.split("]")[1]
                       else f"{stem}({text})")
    return ",".join(out)


_HOST_NUM = re.compile(r"^(.*?)(\d+)$")
SLURM_SHOWN = 400
"""Longest Slurm hostlist written beside the short form in text; a longer one is counted (the
JSON report's `hostlist` and rank table have every name)."""


def hosts_text(hosts: list[str]) -> str:
    """Hosts for a person and for a scheduler: the short form (`format_hosts`) and, where it
    is not already the same, Slurm's hostlist beside it."""
    human, slurm = format_hosts(hosts), slurm_hostlist(hosts)
    if human == slurm:
        return human
    if len(slurm) > SLURM_SHOWN:
        return f"{human} (Slurm hostlist: {len(slurm)} characters, too long to show; see the JSON report)"
    return f"{human} (Slurm hostlist: {slurm})"


DEFAULT_WIDTH = 100
"""Columns of text output when it does not go to a terminal (a pipe, a file, CI's log)."""
MIN_WIDTH = 40
"""Narrowest width text is fitted to (a narrower terminal gets lines of this width)."""


def terminal_width() -> int:
    """The width text output is fitted to: $COLUMNS when set, the terminal's width when stdout
    is one, else DEFAULT_WIDTH; never under MIN_WIDTH."""
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return max(int(columns), MIN_WIDTH)
    if _is_tty(sys.stdout):
        return max(shutil.get_terminal_size((DEFAULT_WIDTH, 24)).columns, MIN_WIDTH)
    return DEFAULT_WIDTH


_MIN_COLUMN = 8
"""Narrowest a table's column is squeezed to before the table is left wider than the width."""


def _column_widths(cols: list[str], cells: list[list[str]], width: int | None) -> list[int]:
    """Each column's width: its longest cell; when the table is wider than `width`, the widest
    columns are narrowed (their cells wrapped) until it fits, none under its header or _MIN_COLUMN."""
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(cols)]
    if width is None:
        return widths
    floor = [max(len(c), _MIN_COLUMN) for c in cols]
    if sum(floor) + 2 * (len(floor) - 1) > width:
        return widths  # it cannot fit: rows kept whole (a name cut over lines reads and greps worse)
    while sum(widths) + 2 * (len(widths) - 1) > width:
        i = max(range(len(widths)), key=lambda j: widths[j] - floor[j])
        if widths[i] <= floor[i]:
            break
        widths[i] -= 1
    return widths


def _wrapped_row(values: list[str], widths: list[int]) -> list[str]:
    """One table row as lines: each cell wrapped to its column's width."""
    parts = [textwrap.wrap(v, w, break_on_hyphens=False) or [""] if len(v) > w else [v]
             for v, w in zip(values, widths, strict=True)]
    height = max(len(p) for p in parts)
    return ["  ".join((p[k] if k < len(p) else "").ljust(w) for p, w in zip(parts, widths, strict=True)).rstrip()
            for k in range(height)]


def render_table(rows: list[dict[str, Any]], columns: list[str] | None = None, width: int | None = None) -> str:
    """A plain fixed-width table of dict rows (used for probes' structured details). `width`:
    the columns it may take; a wider table has its widest cells wrapped onto more lines. No
    line ends in spaces."""
    if not rows:
        return "(empty)"
    cols = columns or list(rows[0].keys())
    cells = [[str(row.get(c, "")) for c in cols] for row in rows]
    widths = _column_widths(cols, cells, width)
    out = _wrapped_row(cols, widths) + ["  ".join("-" * w for w in widths)]
    for r in cells:
        out += _wrapped_row(r, widths)
    return "\n".join(out)


def _fit_title(title: str, width: int) -> list[str]:
    """The first line within `width`, broken only after its commas (a run's name stays with
    its source, a count with its noun); a part longer than the width is cut where it must be."""
    if len(title) <= width:
        return [title.rstrip()]
    glued = re.sub(r"(?<!,) ", "\x00", title)
    return [ln.replace("\x00", " ").rstrip() for ln in textwrap.wrap(glued, width, subsequent_indent="  ",
                                                                     break_on_hyphens=False)]


class _Whole(str):
    """A line of a table: fitted by the table itself, never wrapped again."""


def _fit(lines: list[str], width: int) -> list[str]:
    """Every line within `width`: a longer one wrapped, its continuation indented two more than
    it (a table's lines excepted: the table fitted them, or keeps its rows whole when it
    cannot); trailing spaces dropped."""
    out = []
    for line in lines:
        if isinstance(line, _Whole):
            out.append(str(line).rstrip())
            continue
        line = line.rstrip()
        if len(line) <= width:
            out.append(line)
            continue
        lead = line[: len(line) - len(line.lstrip())]
        more = lead + "  " if len(lead) + 2 < width // 2 else lead
        out += textwrap.wrap(line.strip(), width, initial_indent=lead, subsequent_indent=more,
                             break_on_hyphens=False, drop_whitespace=True) or [line[:width]]
    return out


_OWN = "/distdiag/"
_JOB_WORK = ("/distdiag/probes/", "/distdiag/workloads/", "/distdiag/runtime/comm.py", "/distdiag/runtime/faults.py")
"""distdiag's code that does a check's work: where a rank is, as any job's line (as
distdiag.hang.views reads stacks: the report package does not import it)."""
_FRAME_LINE = re.compile(r"^\s*(?P<path>[^\s:][^:]*):\d+ in \S")
_TB_FRAME = re.compile(r'^\s*File "(?P<path>[^"]+)", line \d+')


def runner_frame(path: str) -> bool:
    """A frame of distdiag's own runner or watchdog, or of runpy (how `-m` and the zero-code
    wrapper start a script): how the job was run, never where it is."""
    return ((_OWN in path and not any(w in path for w in _JOB_WORK)) or path.endswith("/runpy.py")
            or path == "<frozen runpy>")


def without_runner_frames(lines: list[str]) -> tuple[list[str], int]:
    """Stack and traceback lines without distdiag's and runpy's frames (a traceback frame's
    source line goes with it); (the lines kept, how many frames were left out)."""
    kept: list[str] = []
    hidden = 0
    skip_source = False
    for line in lines:
        if skip_source:
            skip_source = False
            if line.startswith("    ") and not _TB_FRAME.match(line):
                continue
        m = _FRAME_LINE.match(line) or _TB_FRAME.match(line)
        if m is not None and runner_frame(m.group("path")):
            hidden += 1
            skip_source = m.re is _TB_FRAME
            continue
        kept.append(line)
    return kept, hidden


def _finding_lines(f: Finding, world_size: int, width: int, host_of: dict[int, str] | None = None) -> list[str]:
    head = f"  [{_SEV[f.severity]}] {format_ranks(f.ranks, world_size)}: {f.issue}"
    lines = textwrap.wrap(head, width, subsequent_indent="      ") or [head]
    if f.evidence:
        for part in f.evidence.splitlines():
            lines += textwrap.wrap(
                part, width, initial_indent="      evidence: ", subsequent_indent="        "
            ) or []
            break
        extra, hidden = without_runner_frames(f.evidence.splitlines()[1:])
        lines += [f"        {x}" for x in extra[:30]]
        if len(extra) > 30:
            lines.append(f"        ... ({len(extra) - 30} more lines in the JSON report)")
        if hidden:
            lines.append(f"        ({hidden} frame(s) of distdiag's runner and runpy left out; the JSON report has them)")
    if f.fix:
        lines += textwrap.wrap(
            f.fix, width, initial_indent="      fix: ", subsequent_indent="        "
        )
    if f.drain:
        where = ", ".join(f"{k}={v}" for k, v in f.drain.items())
        lines.append(f"      DRAIN: take this node out ({where})")
    hosts = sorted({host_of[r] for r in f.ranks if r in host_of}) if host_of else []
    if len(hosts) > 1:  # one host is named in the sentences; a set of them is given whole here
        lines += textwrap.wrap(f"{len(hosts)} hosts: {hosts_text(hosts)}", width, initial_indent="      on ",
                               subsequent_indent="        ", break_on_hyphens=False)
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
    elif probe.metrics.get("model") == "built-in model":  # no --target: distdiag's own workload
        summary = f"{summary}; built-in model" if summary else "built-in model"
    return f"{probe.name.ljust(name_w)}  {_MARK[probe.status]:<6}  {probe.duration_s:7.2f}s  {summary or '-'}"


def _detail_tables(probe: ProbeResult, max_rows: int | None, width: int | None = None) -> list[str]:
    """A probe's `table:` details, each cut at `max_rows` rows with a line saying how many more."""
    out: list[str] = []
    for name, table in probe.details.items():
        if name.startswith("table:") and isinstance(table, list) and table and all(isinstance(r, dict) for r in table):
            out.append(f"  {name[6:]}:")
            shown = table if max_rows is None else table[:max_rows]
            out += [_Whole(("    " + ln).rstrip()) for ln in render_table(shown, width=None if width is None else width - 4).splitlines()]
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
    width: int | None = None,
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
    command given `--exit-zero`): the verdict line prints that one and
    says the verdict's code beside it, so a printed exit code is always the one returned.
    `width`: the columns lines are fitted to (default: `terminal_width()`); a long verdict
    line wraps, its continuation indented.
    """
    width = terminal_width() if width is None else max(width, MIN_WIDTH)
    floor = SEVERITIES.index(min_severity or ("info" if verbose else "warning"))
    # every string here may come from a file (`report show`, `hang-report`, analyze's logs):
    # escaped before wrapping and splitting (which would act on a CR or a C1 line break)
    hosts = {printable(h) for h in known_hosts(report)}
    host_of = {r.rank: printable(r.host) for r in report.ranks if r.host not in ("", "?")}
    report = Report.from_dict(_printable_shown(_shown_dict(report), max_rows))
    out: list[str] = []
    out.append(
        title
        or f"distdiag check: {report.world_size} rank(s) on {len(hosts) or 1} host(s)"
        + (f", restart {report.restart_count}" if report.restart_count else "")
    )
    name_w = max([len("probe")] + [len(p.name) for p in report.probes])
    out.append(f"{'probe'.ljust(name_w)}  status  time      findings")
    out.append(f"{'-' * name_w}  ------  --------  --------")
    for probe in report.probes:
        out += _probe_row_lines(probe, name_w, width)
        for f in probe.findings:
            if SEVERITIES.index(f.severity) >= floor:
                out += _finding_lines(f, report.world_size, width, host_of)
        troubled = probe.status in ("warn", "fail", "error") or any(f.severity != "info" for f in probe.findings)
        if verbose or troubled:
            out += _detail_tables(probe, max_rows, width)
    if report.not_run:
        out.append(f"not run: {', '.join(report.not_run)} (the run ended early)")
    if verbose or floor == 0:  # a healthy compact run stays one line per probe (its notes: JSON, stderr)
        out += [f"note: {note}" for note in report.notes]
    out.append("")
    out = [*_fit_title(out[0], width), *_fit(out[1:], width), *_verdict_lines(report, exit_code, width)]
    return printable("\n".join(out))  # the title too


def _probe_row_lines(probe: ProbeResult, name_w: int, width: int) -> list[str]:
    """A probe's row, wrapped under its findings column when it is wider than `width`."""
    row = _probe_row(probe, name_w)
    hang = " " * (name_w + 21)
    if len(row) <= width or len(hang) > width // 2:
        return [row]
    return textwrap.wrap(row, width, subsequent_indent=hang, break_on_hyphens=False)


def _verdict_lines(report: Report, exit_code: int | None, width: int) -> list[str]:
    """'verdict: FAIL (exit 3) - summary' as one line (the last thing printed, one line for
    scripts and people alike), its summary cut with '...' past `width`: a failing run's findings
    above it say it whole, a passing run's rows say what ran, the JSON has it all. The code
    printed is the one the command returns (with --exit-zero, the verdict's beside it)."""
    code = f"exit {report.exit_code}"
    if exit_code is not None and exit_code != report.exit_code:
        code = f"exit {exit_code} with --exit-zero; the verdict's code is {report.exit_code}"
    head = f"verdict: {report.verdict.upper()} ({code}) - "
    line = head + report.summary
    if len(line) <= width and "\n" not in line:
        return [line]
    line = " ".join(line.split())
    if len(line) <= width:
        return [line]
    return [line[: max(width - 3, len(head) + 12)].rstrip() + "..."]  # never cut into the code


def _shown_dict(report: Report) -> dict[str, Any]:
    """What the text reads of `report.to_dict()`: without the rank table and `by_node`, whose
    only use here is the hosts' count (16k rows of each at 16k ranks, copied and escaped for
    nothing)."""
    return {"schema": report.schema, "verdict": report.verdict, "exit_code": report.exit_code,
            "summary": report.summary, "world_size": report.world_size, "restart_count": report.restart_count,
            "probes": [p.to_dict() for p in report.probes], "not_run": list(report.not_run),
            "notes": list(report.notes)}


def _printable_shown(data: dict[str, Any], max_rows: int | None) -> dict[str, Any]:
    """The report's dict with what the text shows made printable: of a probe's details only
    its tables' first `max_rows` rows are shown (the rest are counted), so only those are
    copied - a 16k-rank hang report's details are ~100 MB of per-rank records."""
    out = _printable_tree({k: v for k, v in data.items() if k != "probes"})
    out["probes"] = []
    for probe in data.get("probes", []):
        details = probe.get("details") or {}
        shown: dict[str, Any] = {}
        for name, table in details.items():
            if name.startswith("table:") and isinstance(table, list):
                cut = len(table) if max_rows is None else max_rows
                shown[printable(name)] = _printable_tree(table[:cut]) + table[cut:]
        out["probes"].append({**_printable_tree({k: v for k, v in probe.items() if k != "details"}), "details": shown})
    return out


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

    def __init__(self, stream: TextIO | None, beat: PlainBeat | None = None) -> None:
        self.stream = stream
        self.width = 0
        self.beat = beat

    @classmethod
    def for_check(cls, config: Any, rank: int) -> ProgressLine:
        if rank != 0 or config.format != "text" or config.quiet:
            return cls(None)
        if _is_tty(sys.stdout) and _is_tty(sys.stderr):
            return cls(sys.stderr)
        if os.environ.get(PROGRESS_ENV) == "stdout" and _is_tty(sys.stdout):
            return cls(sys.stdout)
        return cls(None, PlainBeat(sys.stderr, config.timeout_s))  # plain logs: a line every BEAT_S

    def show(self, index: int, total: int, name: str) -> None:
        if self.beat is not None:
            self.beat.at(index, total, name)
        if self.stream is None:
            return
        text = f"distdiag [{index + 1}/{total}] {name} ..."
        self._write("\r" + text.ljust(self.width) + "\r")
        self.width = len(text)

    def clear(self) -> None:
        """Blank the line for good: nothing is shown after the verdict."""
        if self.beat is not None:
            self.beat.stop()
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


BEAT_S = 10.0
"""How often rank 0 says where the check is in plain logs (CI, Slurm: no terminal to redraw)."""


_BEAT = re.compile(r"^distdiag check: (\d+ s in: probe |starting \d+ rank)")


def is_beat_line(line: str) -> bool:
    """A PlainBeat line or the check's start line (the launcher shows them as they come)."""
    return bool(_BEAT.match(line))


class PlainBeat:
    """Signs of life for output that is not a terminal: every BEAT_S, one line on rank 0 naming
    the probe running, for how long and against which deadline (a check that is quiet for a
    minute in a CI log looks hung). Nothing before the first BEAT_S (a healthy check is done by
    then) or after `stop()` (the verdict). One named daemon thread, started by the first probe."""

    def __init__(self, stream: TextIO, timeout_s: float, every_s: float = BEAT_S) -> None:
        import threading

        self.stream, self.timeout_s, self.every_s = stream, timeout_s, every_s
        self.started = self.probe_started = 0.0
        self.where = ""
        self.done = threading.Event()
        self.thread: threading.Thread | None = None

    def at(self, index: int, total: int, name: str) -> None:
        import threading
        import time

        self.probe_started = time.monotonic()
        self.where = f"probe {name} [{index + 1}/{total}]"
        if self.thread is None and not self.done.is_set():
            self.started = self.probe_started
            self.thread = threading.Thread(target=self._run, name="distdiag-progress", daemon=True)
            self.thread.start()

    def stop(self) -> None:
        self.done.set()

    def line(self, now: float) -> str:
        return (f"distdiag check: {now - self.started:.0f} s in: {self.where} running for {now - self.probe_started:.0f} s "
                f"of its {self.timeout_s:g} s")

    def _run(self) -> None:
        import time

        while not self.done.wait(self.every_s):
            try:
                self.stream.write(self.line(time.monotonic()) + "\n")
                self.stream.flush()
            except (OSError, ValueError):  # the log went away: stop saying anything, never the check
                return
