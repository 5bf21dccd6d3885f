"""The hang watchdog embedded in training jobs (issue 3; docs/watchdog.md).

`HangWatchdog` is the in-code API, `python -m distdiag.watch` the zero-code wrapper and
`distdiag hang-report DIR` renders what it wrote. Importing this package does not import
torch; arming does.
"""

from __future__ import annotations

from distdiag.errors import HangDetected
from distdiag.watchdog.config import (
    ACTIONS,
    EXIT_WATCHDOG,
    WATCHDOG_ACTION,
    WATCHDOG_DUMP_DIR,
    WATCHDOG_FLIGHT_RECORDER,
    WATCHDOG_HISTORY,
    WATCHDOG_TIMEOUT_S,
    WatchdogConfig,
)
from distdiag.watchdog.core import HangWatchdog

__all__ = [
    "HangWatchdog",
    "HangDetected",
    "WatchdogConfig",
    "ACTIONS",
    "EXIT_WATCHDOG",
    "WATCHDOG_TIMEOUT_S",
    "WATCHDOG_ACTION",
    "WATCHDOG_DUMP_DIR",
    "WATCHDOG_FLIGHT_RECORDER",
    "WATCHDOG_HISTORY",
]
