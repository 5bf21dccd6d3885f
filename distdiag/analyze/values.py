"""What every log reader shares: the one error type, and values read defensively.

LogFormatError (one line: file, where, what is wrong, the format expected), numbers that
accept "nan"/"inf" strings, UTF-8 decoding that names the first bad byte, JSON whose depth is
an error rather than a RecursionError, and findings written into logs checked field by field.
readers.py, hf_state.py and tfevents.py import this; it imports none of them.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from distdiag.errors import DistDiagError

__all__ = ["LogFormatError", "number", "short", "decode", "parse_json", "monitor_finding", "read_log"]


class LogFormatError(DistDiagError, ValueError):
    """A metric log that cannot be read: missing, empty, malformed or of an unknown format."""


def number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return float(value) if abs(value) < 1 << 1023 else math.copysign(math.inf, value)
    if isinstance(value, float):
        return value
    if isinstance(value, str) and value.strip().lower() in ("nan", "inf", "+inf", "-inf", "infinity", "+infinity", "-infinity"):
        return float(value.strip().lower().replace("infinity", "inf"))
    return None


def short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def decode(path: Path, blob: bytes, expected: str) -> str:
    """UTF-8 text (a BOM is dropped); anything else is one line naming the first bad byte."""
    try:
        return blob.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise LogFormatError(
            f"{path}: not a text file: byte 0x{blob[exc.start]:02x} at offset {exc.start} is not UTF-8 (expected {expected})"
        ) from None


def read_log(path: Path, expected: str) -> bytes:
    """A log file's bytes; a FIFO, device or directory (which would block or never end), a link
    loop or a file over safefile.MAX_LOG_BYTES is one line naming it (distdiag/report/safefile.py)."""
    from distdiag.report.safefile import MAX_LOG_BYTES, RefusedFile, read_bytes_limited

    try:
        return read_bytes_limited(path, MAX_LOG_BYTES, expected)
    except RefusedFile as exc:
        raise LogFormatError(str(exc)) from None


def parse_json(text: str, where: str) -> Any:
    """json.loads whose failures are one line; deep nesting is an error, not a RecursionError,
    and an integer too long for Python to convert (over 4300 digits) one too, not a ValueError."""
    try:
        return json.loads(text)
    except RecursionError:
        raise LogFormatError(f"{where}: JSON nested too deeply to be a metric log") from None
    except ValueError as exc:
        if isinstance(exc, json.JSONDecodeError):
            raise
        raise LogFormatError(
            f"{where}: holds an integer of over {sys.get_int_max_str_digits()} digits, not a metric value"
        ) from None


def monitor_finding(raw: Any, step: Any, where: str) -> dict[str, Any]:
    """A finding a TrainingMonitor (or a trainer callback) wrote into a log, checked field by field."""
    from distdiag.report.model import SEVERITIES

    if not isinstance(raw, dict):
        raise LogFormatError(f"{where}: the finding is a JSON {type(raw).__name__}, expected an object")
    checks = {
        "severity": lambda v: v in SEVERITIES,
        "issue": lambda v: isinstance(v, str),
        "evidence": lambda v: isinstance(v, str),
        "fix": lambda v: isinstance(v, str),
        "ranks": lambda v: isinstance(v, list) and all(isinstance(r, int) and not isinstance(r, bool) for r in v),
        "confidence": lambda v: number(v) is not None,
    }
    expected = {"severity": f"one of {', '.join(SEVERITIES)}", "issue": "a string", "evidence": "a string", "fix": "a string",
                "ranks": "a list of rank numbers", "confidence": "a number"}
    for key, ok in checks.items():
        if (key in raw or key in ("severity", "issue")) and not ok(raw.get(key)):
            raise LogFormatError(f"{where}: finding field {key!r} is {short(raw.get(key))}, expected {expected[key]}")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
        raise LogFormatError(f"{where}: the finding's step is {short(step)}, expected an integer")
    return {"step": step, **{k: raw[k] for k in ("severity", "issue", "evidence", "ranks", "fix", "confidence") if k in raw}}
