"""distdiag: diagnostics for distributed PyTorch training.

Importing distdiag has no side effects and does not import torch: the public names below
are loaded on first use (PEP 562), so `distdiag report show` and other light commands stay
fast.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

__version__ = "0.1.0"

__all__ = [
    "Finding",
    "ProbeResult",
    "Report",
    "read_report",
    "write_report",
    "ConfigError",
    "DistDiagError",
    "TrainingMonitor",
    "HangWatchdog",
    "HangDetected",
]

# public name -> module that defines it
_LAZY: dict[str, str] = {
    "Finding": "distdiag.report",
    "ProbeResult": "distdiag.report",
    "Report": "distdiag.report",
    "read_report": "distdiag.report",
    "write_report": "distdiag.report",
    "ConfigError": "distdiag.errors",
    "DistDiagError": "distdiag.errors",
    "TrainingMonitor": "distdiag.monitor",
    "HangWatchdog": "distdiag.watchdog",
    "HangDetected": "distdiag.errors",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'distdiag' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
