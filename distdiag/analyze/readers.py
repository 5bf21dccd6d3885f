"""Reading metric logs users already have, recognised by their content (not their name):

- JSON lines: one JSON object a line. distdiag's own metrics log (TrainingMonitor) and generic
  `{"step": 10, "loss": 2.3}` lines alike; nested objects flatten to `a/b`; the step comes from
  `step`, `global_step`, `iteration`, `iter` or `_step` (else the line number).
- A JSON document: the Hugging Face Trainer's trainer_state.json (distdiag.analyze.hf_state), or
  an array of such records.
- CSV: a header row, a step column (same names, case-insensitive; else the row number) and
  numeric columns; empty cells are missing values, `nan`/`inf` are kept as such. Lightning's
  CSVLogger metrics.csv (train and validation rows mixed, `epoch` beside `step`) and W&B exports
  (`Run name - metric` columns with `__MIN`/`__MAX` companions) read as they are.
- TensorBoard: `events.out.tfevents.*` files or a directory holding them (distdiag.analyze.tfevents).
- A directory: trainer_state.json, else event files, else the latest checkpoint-*/trainer_state.json,
  else a metrics.csv.

A malformed file raises LogFormatError with one line naming the file, where, what is wrong and
the format expected. A truncated LAST line or record (the writer was killed, the usual state of
a crashed run's log) is skipped with a note, unless strict=True.
"""

from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path
from typing import Any

from distdiag.analyze.series import Run
from distdiag.analyze.values import LogFormatError, decode, monitor_finding, parse_json, read_log
from distdiag.analyze.values import number as _number
from distdiag.analyze.values import short as _short

__all__ = ["LogFormatError", "load_run", "read_jsonl", "read_csv", "parse_json", "monitor_finding", "STEP_KEYS", "FORMATS"]

STEP_KEYS = ("step", "global_step", "iteration", "iter", "_step", "trainer/global_step")
_SKIP_KEYS = {"time", "timestamp", "_timestamp", "_runtime", "wall_time", "epoch", "rank", "kind", "schema"}
FORMATS = "JSON lines, a Hugging Face trainer_state.json, CSV (Lightning's metrics.csv, a W&B export) or TensorBoard event files"
"""What `distdiag analyze` reads, as error messages name it."""
MAX_DEPTH = 64
"""JSON nested deeper than this is not a metric log (and would exhaust Python's recursion)."""
_WANDB_COLUMN = re.compile(r"^(?P<run>.+?) - (?P<metric>.+)$")


def _flatten(prefix: str, obj: Any, out: dict[str, float], depth: int = 0) -> None:
    if isinstance(obj, dict):
        if depth >= MAX_DEPTH:
            raise ValueError(f"objects nested more than {MAX_DEPTH} levels deep")
        for k, v in obj.items():
            _flatten(f"{prefix}/{k}" if prefix else str(k), v, out, depth + 1)
        return
    num = _number(obj)
    if num is not None:
        out[prefix] = num


def _step_of(record: dict[str, Any], keys: tuple[str, ...]) -> int | None:
    for key in keys:
        if key in record:
            value = _number(record[key])
            if value is None or not math.isfinite(value):
                raise ValueError(f"step {key!r} is {_short(record[key])}, not a number")
            return int(value)
    return None


def add_record(run: Run, record: dict[str, Any], default_step: int, where: str) -> None:
    """One generic metrics record (a JSONL line, an element of a JSON array)."""
    kind = record.get("kind")
    if kind == "finding" and "finding" in record:
        run.monitor_findings.append(monitor_finding(record["finding"], record.get("step"), where))
        return
    if kind == "header":
        return
    try:
        step = _step_of(record, STEP_KEYS)
        flat: dict[str, float] = {}
        for key, value in record.items():
            if key in STEP_KEYS or key in _SKIP_KEYS:
                continue
            _flatten(key, value, flat)
    except ValueError as exc:
        raise LogFormatError(f"{where}: {exc}") from None
    for name, value in flat.items():
        run.add(name, default_step if step is None else step, value)


def read_jsonl(path: Path, *, strict: bool = False, label: str | None = None, text: str | None = None) -> Run:
    run = Run(label=label or path.stem, source=str(path), format="jsonl")
    if text is None:
        text = decode(path, read_log(path, "a JSON lines log"), "JSON lines")
    lines = text.splitlines()
    ends_clean = text.endswith("\n")
    for i, line in enumerate(lines):
        lineno = i + 1
        if not line.strip():
            continue
        try:
            record = parse_json(line, f"{path}: line {lineno}")
        except json.JSONDecodeError as exc:
            if i == len(lines) - 1 and not ends_clean and not strict:
                run.notes.append(f"{path}: skipped a truncated last line {lineno} (the writer stopped mid-line)")
                continue
            raise LogFormatError(f"{path}: line {lineno} is not valid JSON ({exc.msg} at column {exc.colno}); expected JSON lines") from None
        if not isinstance(record, dict):
            raise LogFormatError(f"{path}: line {lineno} holds a JSON {type(record).__name__}, expected an object")
        add_record(run, record, lineno, f"{path}: line {lineno}")
    run.finish()
    return run


def _columns(header: list[str]) -> tuple[list[str | None], str]:
    """Metric names of CSV columns (None: not a metric) and the flavour of the file.

    A W&B panel export names columns `RUN - METRIC`, beside `RUN - METRIC__MIN/__MAX` (the range
    of the points W&B bucketed into one): the run prefix goes, the range columns are skipped.
    Lightning's CSVLogger writes `epoch` and `step` beside the metrics.
    """
    lowered = [h.lower() for h in header]
    runs = {m.group("run") for h in header if (m := _WANDB_COLUMN.match(h))}
    names: list[str | None] = []
    if len(runs) == 1:
        for h in header:
            m = _WANDB_COLUMN.match(h)
            metric = m.group("metric") if m else h
            names.append(None if metric.endswith(("__MIN", "__MAX")) else metric)
        return names, "wandb_csv"
    flavour = "lightning_csv" if "step" in lowered and "epoch" in lowered else "csv"
    if "_step" in lowered or "_runtime" in lowered:
        flavour = "wandb_csv"  # the history of W&B's public API, written out with pandas
    return list(header), flavour


def read_csv(path: Path, *, strict: bool = False, label: str | None = None, text: str | None = None) -> Run:
    if text is None:
        text = decode(path, read_log(path, "a CSV log"), "CSV")
    try:
        rows = [r for r in csv.reader(text.splitlines()) if any(c.strip() for c in r)]
    except csv.Error as exc:
        raise LogFormatError(f"{path}: not valid CSV ({exc})") from None
    if not rows:
        raise LogFormatError(f"{path}: empty CSV file, expected a header row and metric rows")
    header = [h.strip() for h in rows[0]]
    lowered = [h.lower() for h in header]
    names, flavour = _columns(header)
    run = Run(label=label or path.stem, source=str(path), format=flavour)
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
                value = float(row[step_col])
                if not math.isfinite(value):
                    raise ValueError
                step = int(value)
            except ValueError:
                raise LogFormatError(f"{path}: row {r}: step {row[step_col][:40]!r} is not a number") from None
        for c, cell in enumerate(row):
            cell = cell.strip()
            name = names[c]
            if c == step_col or not cell or name is None or name.lower() in _SKIP_KEYS:
                continue
            try:
                value = float(cell)
            except ValueError:
                if last and not text.endswith("\n") and not strict:
                    run.notes.append(f"{path}: skipped a truncated last row {r}")
                    break
                raise LogFormatError(f"{path}: row {r}, column {header[c]!r}: {cell[:40]!r} is not a number") from None
            run.add(name, step, value)
    run.finish()
    return run


def _read_records(path: Path, records: list, label: str | None) -> Run:
    run = Run(label=label or path.stem, source=str(path), format="json")
    for i, record in enumerate(records):
        if not isinstance(record, dict):
            raise LogFormatError(f"{path}: element {i} of the JSON array is a {type(record).__name__}, expected an object of metrics")
        add_record(run, record, i, f"{path}: element {i}")
    run.finish()
    return run


def _is_tfevents(path: Path) -> bool:
    return "tfevents" in path.name


def _looks_like_tfrecord(blob: bytes) -> bool:
    from distdiag.analyze.tfevents import masked_crc

    return len(blob) >= 12 and masked_crc(blob[:8]) == int.from_bytes(blob[8:12], "little")


def _read_json_document(p: Path, text: str, strict: bool, label: str | None) -> Run:
    """Text starting with { or [: JSON lines, or one document (trainer_state.json, an array)."""
    from distdiag.analyze.hf_state import is_trainer_state, read_trainer_state

    first = next(line for line in text.splitlines() if line.strip())
    try:
        head = parse_json(first, f"{p}: line 1")
    except json.JSONDecodeError:
        head = None
    if isinstance(head, dict) and not is_trainer_state(head):
        return read_jsonl(p, strict=strict, label=label, text=text)
    try:
        doc = parse_json(text, str(p))
    except json.JSONDecodeError as exc:
        if head is None and text.lstrip().startswith("{") and "\n" in text.strip():
            raise LogFormatError(
                f"{p}: neither JSON lines (line 1 is not valid JSON) nor one JSON document ({exc.msg} at line {exc.lineno} "
                f"column {exc.colno}); expected {FORMATS}"
            ) from None
        return read_jsonl(p, strict=strict, label=label, text=text)
    if isinstance(doc, dict) and is_trainer_state(doc):
        return read_trainer_state(p, doc, label=label)
    if isinstance(doc, list) and doc and all(isinstance(x, dict) for x in doc):
        return _read_records(p, doc, label)
    if isinstance(doc, dict):
        keys = ", ".join(sorted(map(str, doc))[:8])
        raise LogFormatError(
            f"{p}: a JSON document that is not a Hugging Face trainer_state.json (no 'log_history' list; keys: {keys}); "
            f"expected {FORMATS}"
        )
    return read_jsonl(p, strict=strict, label=label, text=text)


def _read_file(p: Path, strict: bool, label: str | None) -> Run:
    from distdiag.analyze.tfevents import read_tfevents

    blob = read_log(p, "a metrics log")
    suffix = p.suffix.lower()
    if _is_tfevents(p) or (blob and _looks_like_tfrecord(blob)):
        return read_tfevents([p], strict=strict, label=label or p.parent.name or p.name, source=str(p))
    jsonish = suffix in (".jsonl", ".json", ".ndjson", ".log", ".txt")
    if suffix == ".csv":
        return read_csv(p, strict=strict, label=label, text=decode(p, blob, "CSV"))
    if not blob.strip():
        return read_jsonl(p, strict=strict, label=label, text="") if jsonish else Run(label or p.stem, str(p))
    if not jsonish:
        try:
            text = blob.decode("utf-8-sig")
        except UnicodeDecodeError:
            text = ""
        if not text or "\x00" in text:
            raise LogFormatError(f"{p}: unknown log format, not text (expected {FORMATS})")
    else:
        text = decode(p, blob, "JSON lines or a JSON document such as trainer_state.json")
    if text.lstrip()[:1] in ("{", "["):
        return _read_json_document(p, text, strict, label)
    first = text.lstrip().splitlines()[0]
    if "," in first and not first.lstrip().startswith(("{", "[", '"{')):
        return read_csv(p, strict=strict, label=label, text=text)  # a CSV header, whatever the name
    if jsonish:
        return read_jsonl(p, strict=strict, label=label, text=text)
    raise LogFormatError(f"{p}: unknown log format (expected {FORMATS})")


def _read_dir(p: Path, strict: bool, label: str | None) -> Run:
    from distdiag.analyze.hf_state import latest_checkpoint_state, read_trainer_state_file
    from distdiag.analyze.tfevents import read_tfevents

    name = label or p.name
    if (p / "trainer_state.json").is_file():
        return read_trainer_state_file(p / "trainer_state.json", label=name)
    files = sorted(f for f in p.rglob("*") if f.is_file() and _is_tfevents(f))
    if files:
        return read_tfevents(files, strict=strict, label=name, source=str(p))
    state = latest_checkpoint_state(p)
    if state is not None:
        return read_trainer_state_file(state, label=name)
    metrics = sorted(p.rglob("metrics.csv"))
    if len(metrics) == 1:
        return read_csv(metrics[0], strict=strict, label=name)
    what = f"{len(metrics)} metrics.csv files (name one)" if metrics else "no log distdiag reads"
    raise LogFormatError(
        f"{p}: a directory with {what}; expected TensorBoard event files (events.out.tfevents.*), "
        "a Hugging Face trainer_state.json (also in checkpoint-*/) or a Lightning metrics.csv"
    )


def load_run(path: str | Path, *, strict: bool = False, label: str | None = None) -> Run:
    """Read one log: a file of any format above (recognised by content), or a log directory."""
    p = Path(path)
    if not p.exists():
        raise LogFormatError(f"{p}: no such file or directory")
    run = _read_dir(p, strict, label) if p.is_dir() else _read_file(p, strict, label)
    if not run.series:
        raise LogFormatError(f"{p}: no numeric metrics found (expected lines like {{\"step\": 1, \"loss\": 2.3}})")
    return run
