"""Error types. User mistakes are `ConfigError` (exit code 2); internal invariants use assert."""

from __future__ import annotations

import traceback
from typing import Any

__all__ = [
    "DistDiagError",
    "ConfigError",
    "ProbeError",
    "HangDetected",
    "ReportError",
    "COMM_ERROR_MARKERS",
    "error_summary",
    "mentions_broken_connection",
]

COMM_ERROR_MARKERS = ("Connection closed by peer", "Connection reset by peer", "gloo/transport", "Broken pipe", "NCCL error")
"""Text of the errors a collective raises when a peer died or its connection broke (gloo names
an address, not a rank: FACTS.md)."""


def mentions_broken_connection(exc: BaseException) -> bool:
    text = str(exc)
    return any(marker in text for marker in COMM_ERROR_MARKERS)


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message ('' for none)."""
    text = str(exc)
    return text.splitlines()[0] if text else ""


def exc_line(exc: BaseException) -> str:
    """'Type: first line of the message', how findings quote an exception."""
    return f"{type(exc).__name__}: {first_line(exc)}"


def error_summary(exc: BaseException) -> dict[str, Any]:
    """An exception as the report carries it: type, first line of the message, traceback tail."""
    tb = traceback.format_exception(type(exc), exc, exc.__traceback__, limit=8)
    message = first_line(exc)[:500]
    return {"type": type(exc).__name__, "message": message, "traceback": "".join(tb)[-4000:]}


class DistDiagError(Exception):
    """Base class of every error distdiag raises on purpose."""


class ConfigError(DistDiagError, ValueError):
    """Bad input: a malformed config, an unknown probe or key, a world size a probe cannot use.

    The message is one line that names the value, the valid range and the fix; the check
    prints it and exits with code 2 on every rank.
    """


class ProbeError(DistDiagError):
    """A probe could not do its job for a reason it understands (not a bug in the probe)."""


class HangDetected(DistDiagError):
    """Raised in a training thread by the watchdog when it is asked to raise on a hang."""


class ReportError(DistDiagError):
    """A report file that cannot be read: missing, truncated, not JSON or of another schema."""
