"""Reading metric logs users already have: JSONL, CSV and TensorBoard event files.

Formats:
- JSONL: one JSON object a line. distdiag's own metrics log (TrainingMonitor) and generic
  `{"step": 10, "loss": 2.3}` lines alike; nested objects flatten to `a/b`; the step comes
  from `step`, `global_step`, `iteration`, `iter` or `_step` (else the line number).
- CSV: a header row, a step column (same names, case-insensitive; else the row number) and
  numeric columns; empty cells are missing values, `nan`/`inf` are kept as such.
- TensorBoard: `events.out.tfevents.*` files or a directory holding them (distdiag.analyze.tfevents).

A malformed file raises LogFormatError with one line naming the file, the line and what is
wrong. A truncated LAST line or record (the writer was killed, the usual state of a crashed
run's log) is skipped with a note, unless strict=True.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

from distdiag.analyze.series import Run
from distdiag.errors import DistDiagError

__all__ = ["LogFormatError", "load_run", "read_jsonl", "read_csv", "STEP_KEYS"]

STEP_KEYS = ("step", "global_step", "iteration", "iter", "_step", "trainer/global_step")
_SKIP_KEYS = {"time", "timestamp", "_timestamp", "_runtime", "wall_time", "epoch", "rank", "kind", "schema"}


class LogFormatError(DistDiagError, ValueError):
    """A metric log that cannot be read: missing, empty, malformed or of an unknown format."""


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str) and value.strip().lower() in ("nan", "inf", "+inf", "-inf", "infinity", "-infinity"):
        return float(value.strip().lower().replace("infinity", "inf"))
    return None


def _flatten(prefix: str, obj: Any, out: dict[str, float]) -> None:
    if isinstance(obj, dict):
        for k, v in obj.items():
            _flatten(f"{prefix}/{k}" if prefix else str(k), v, out)
        return
    num = _number(obj)
    if num is not None:
        out[prefix] = num


def _step_of(record: dict[str, Any], keys: tuple[str, ...]) -> int | None:
    for key in keys:
        if key in record:
            value = _number(record[key])
            if value is None or not math.isfinite(value):
                raise ValueError(f"step {key!r} is {record[key]!r}, not a number")
            return int(value)
    return None


def _read_text(path: Path, expected: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise LogFormatError(f"{path}: not a text file (expected {expected})") from None


def read_jsonl(path: Path, *, strict: bool = False, label: str | None = None) -> Run:
    run = Run(label=label or path.stem, source=str(path))
    text = _read_text(path, "JSON lines")
    lines = text.splitlines()
    ends_clean = text.endswith("\n")
    for i, line in enumerate(lines):
        lineno = i + 1
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            if i == len(lines) - 1 and not ends_clean and not strict:
                run.notes.append(f"{path}: skipped a truncated last line {lineno} (the writer stopped mid-line)")
                continue
            raise LogFormatError(f"{path}: line {lineno} is not valid JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(record, dict):
            raise LogFormatError(f"{path}: line {lineno} holds a JSON {type(record).__name__}, expected an object")
        kind = record.get("kind")
        if kind == "finding" and isinstance(record.get("finding"), dict):
            run.monitor_findings.append({"step": record.get("step"), **record["finding"]})
            continue
        if kind == "header":
            continue
        try:
            step = _step_of(record, STEP_KEYS)
        except ValueError as exc:
            raise LogFormatError(f"{path}: line {lineno}: {exc}") from None
        flat: dict[str, float] = {}
        for key, value in record.items():
            if key in STEP_KEYS or key in _SKIP_KEYS:
                continue
            _flatten(key, value, flat)
        for name, value in flat.items():
            run.add(name, lineno if step is None else step, value)
    run.finish()
    return run


def read_csv(path: Path, *, strict: bool = False, label: str | None = None) -> Run:
    run = Run(label=label or path.stem, source=str(path))
    text = _read_text(path, "CSV")
    rows = list(csv.reader(text.splitlines()))
    rows = [r for r in rows if any(c.strip() for c in r)]
    if not rows:
        raise LogFormatError(f"{path}: empty CSV file, expected a header row and metric rows")
    header = [h.strip() for h in rows[0]]
    lowered = [h.lower() for h in header]
    step_col = next((lowered.index(k) for k in STEP_KEYS if k in lowered), None)
    for r, row in enumerate(rows[1:], start=2):
        last = r == len(rows)
        if len(row) != len(header):
            if last and not text.endswith("\n") and not strict:
                run.notes.append(f"{path}: skipped a truncated last row {r} ({len(row)} of {len(header)} columns)")
                continue
            raise LogFormatError(f"{path}: row {r} has {len(row)} columns, the header has {len(header)}")
        step = r - 1
        if step_col is not None:
            try:
                step = int(float(row[step_col]))
            except ValueError:
                raise LogFormatError(f"{path}: row {r}: step {row[step_col]!r} is not a number") from None
        for c, cell in enumerate(row):
            cell = cell.strip()
            if c == step_col or not cell or lowered[c] in _SKIP_KEYS:
                continue
            try:
                value = float(cell)
            except ValueError:
                if last and not text.endswith("\n") and not strict:
                    run.notes.append(f"{path}: skipped a truncated last row {r}")
                    break
                raise LogFormatError(f"{path}: row {r}, column {header[c]!r}: {cell[:40]!r} is not a number") from None
            run.add(header[c], step, value)
    run.finish()
    return run


def _is_tfevents(path: Path) -> bool:
    return "tfevents" in path.name


def load_run(path: str | Path, *, strict: bool = False, label: str | None = None) -> Run:
    """Read one log: a .jsonl/.json/.csv file, an event file, or a directory of event files."""
    from distdiag.analyze.tfevents import read_tfevents

    p = Path(path)
    if not p.exists():
        raise LogFormatError(f"{p}: no such file or directory")
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and _is_tfevents(f))
        if not files:
            raise LogFormatError(f"{p}: a directory without TensorBoard event files (events.out.tfevents.*)")
        run = read_tfevents(files, strict=strict, label=label or p.name, source=str(p))
    elif _is_tfevents(p):
        run = read_tfevents([p], strict=strict, label=label or p.parent.name or p.name, source=str(p))
    elif p.suffix.lower() == ".csv":
        run = read_csv(p, strict=strict, label=label)
    elif p.suffix.lower() in (".jsonl", ".json", ".ndjson", ".log", ".txt"):
        run = read_jsonl(p, strict=strict, label=label)
    else:
        head = p.read_bytes()[:1]
        if head == b"{":
            run = read_jsonl(p, strict=strict, label=label)
        else:
            raise LogFormatError(f"{p}: unknown log format (expected .jsonl, .csv or TensorBoard events.out.tfevents.*)")
    if not run.series:
        raise LogFormatError(f"{p}: no numeric metrics found (expected lines like {{\"step\": 1, \"loss\": 2.3}})")
    return run
