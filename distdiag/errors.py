"""Error types. User mistakes are `ConfigError` (exit code 2); internal invariants use assert."""

from __future__ import annotations

__all__ = ["DistDiagError", "ConfigError", "ProbeError", "HangDetected", "ReportError"]


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
