"""The hang watchdog embedded in training jobs (issue 3; docs/watchdog.md).

`HangWatchdog` is the in-code API, `python -m distdiag.watch` the zero-code wrapper and
`distdiag hang-report DIR` renders what it wrote. Importing this package does not import
torch; arming does.

    core.py       HangWatchdog: arming, step(), phase(), leaving
    config.py     WatchdogConfig and the DISTDIAG_WATCHDOG_* variables
    progress.py   what the training thread records: steps, phases, wrapped collectives
    intercept.py  the optional wrappers around torch.distributed's Python collectives
    dataload.py   the DataLoader tap: batches drawn per pass and where a pass ended (uneven data)
    watcher.py    Watcher, the daemon thread: tick, event, action
    stall.py      when this rank declares a hang (the recorder's counters, steps, phases)
    marks.py      step marks compared across ranks (a desync between steps)
    phases.py     the phase board: a rank in a declared phase excuses the others' waiting
    writer.py     gather the snapshots, run distdiag.hang's rules, write hang-report.json

May import distdiag.hang, distdiag.runtime (the exchange, the stack of a thread),
distdiag.report and distdiag.errors; never the check or the probes.
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
