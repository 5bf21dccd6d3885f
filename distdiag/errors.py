"""Error types. User mistakes are `ConfigError` (exit code 2); internal invariants use assert."""

from __future__ import annotations

import re
import sys
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
    "library_path",
    "publish_caught",
    "set_caught_publisher",
    "print_line",
    "did_you_mean",
    "shown",
    "unknown_option_hint",
]

COMM_ERROR_MARKERS = ("Connection closed by peer", "Connection reset by peer", "gloo/transport", "Broken pipe", "NCCL error")
"""Text of the errors a collective raises when a peer died or its connection broke (gloo names
an address, not a rank: docs/facts.md)."""


def print_line(line: str) -> None:
    """Write one line to stderr in one write. The ranks of a node share torchrun's stderr, and
    print() writes the text and its newline apart, so two ranks' lines could run together."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def did_you_mean(word: str, choices: Any) -> str:
    """' (did you mean 'x'?)' for the closest of `choices` to a mistyped `word`, else ''."""
    import difflib

    if not isinstance(word, str):
        return ""
    close = difflib.get_close_matches(word[:200], [str(c) for c in choices], n=1, cutoff=0.75)
    return f" (did you mean {close[0]!r}?)" if close else ""


def shown(value: Any, limit: int = 80) -> str:
    """repr(value) for a message, cut to `limit` characters (a 100 KB option or a 5,000-digit
    number makes a line nobody reads; an int past Python's digit limit has no repr at all)."""
    try:
        text = repr(value)
    except ValueError:  # int too large to print
        return f"an integer of over {sys.get_int_max_str_digits()} digits"
    return text if len(text) <= limit else f"{text[: limit - 20]}... ({len(text)} characters)"


def unknown_option_hint(parser: Any, message: str) -> str:
    """argparse's message, with "did you mean" for a mistyped option it names (`--probez`)."""
    if message.startswith("unrecognized arguments: "):
        words = message.split(": ", 1)[1].split()
        typo = next((w.split("=", 1)[0] for w in words if w.startswith("-")), None)
        known = [flag for action in parser._actions for flag in action.option_strings]
        if typo is not None:
            return f"unrecognized arguments: {typo[:80]}{did_you_mean(typo, known)}"
        return f"unrecognized arguments: {shown(words[0]) if words else ''}"
    return message if len(message) <= 300 else f"{message[:280]}... ({len(message)} characters)"


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


_GENERIC_FRAMES = frozenset({"wrapper", "inner", "inner_func", "_fn", "decorate_context", "wrapped", "__call__", "<lambda>"})
"""Decorator frames that say nothing of where an exception came from."""
_CALLEE = re.compile(r"([A-Za-z_][\w.]*)\s*\(")


def _is_runpy(filename: str) -> bool:
    return filename == "<frozen runpy>" or filename.replace("\\", "/").endswith("/runpy.py")


def library_path(exc: BaseException, limit: int = 6) -> dict[str, str]:
    """Where an exception was raised, outside distdiag's own frames.

    `raised_at` is the innermost frame ("file:line in func"); `through` the chain from the
    call distdiag made into the library (read from its source line: "dcp.save") to the
    innermost function, decorator frames left out (e.g. "dcp.save -> ... -> gather_object
    -> _tensor_to_object"): which library call a probe's or a hook's exception started in.
    """
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [i for i, f in enumerate(frames) if "/distdiag/" in f.filename.replace("\\", "/")]
    start = ours[-1] + 1 if ours and ours[-1] + 1 < len(frames) else 0
    # runpy's frames are how the zero-code wrapper runs the user's script, not a library call
    outside = [f for f in frames[start:] if not _is_runpy(f.filename)]
    if not outside:
        return {}
    names = [f.name for f in outside if f.name not in _GENERIC_FRAMES] or [outside[-1].name]
    if ours and start:
        match = _CALLEE.search(frames[start - 1].line or "")
        if match and not match.group(1).startswith("runpy."):
            names.insert(0, match.group(1))
    last = outside[-1]
    if len(names) == 1 and names[0] == last.name:
        return {"raised_at": f"{last.filename}:{last.lineno} in {last.name}"}  # the user's own line: no chain
    if len(names) > limit:
        names = names[:1] + ["..."] + names[-(limit - 2):]
    return {"raised_at": f"{last.filename}:{last.lineno} in {last.name}", "through": " -> ".join(names)}


def error_summary(exc: BaseException) -> dict[str, Any]:
    """An exception as the report carries it: type, first line of the message, traceback tail,
    and where outside distdiag it was raised (`library_path`)."""
    tb = traceback.format_exception(type(exc), exc, exc.__traceback__, limit=16)
    message = first_line(exc)[:500]
    return {"type": type(exc).__name__, "message": message, "traceback": "".join(tb)[-4000:], **library_path(exc)}


_caught_publisher: list[Any] = [None]


def set_caught_publisher(publish: Any) -> None:
    """The check installs how a caught exception reaches the other ranks (None: nowhere)."""
    _caught_publisher[0] = publish


def publish_caught(exc: BaseException, where: str = "") -> None:
    """Say, out of band and at once, that this rank caught `exc` and goes on.

    A probe (or the hook wrapper) that catches an exception and carries on to its next
    collective calls this first: if the exception left other ranks waiting in a collective
    this rank will never enter (DCP's save raising on its coordinator only), the hang report
    then leads with this rank's exception instead of blaming the ranks it stranded. Never
    raises; a no-op outside the check (probes called directly, in tests).
    """
    publish = _caught_publisher[0]
    if publish is None:
        return
    try:
        publish(exc, where)
    except Exception:  # noqa: BLE001 - reporting must never add a failure of its own
        pass


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
