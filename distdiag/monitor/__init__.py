"""Training health inside the user's loop: `TrainingMonitor` (docs/monitor.md).

    monitor.py  TrainingMonitor: the hooks a loop calls (after_backward), findings, the log
    look.py     the vector a look all-reduces: its layout, and the findings and record read from it
    checks.py   the checks: vanishing/exploding gradients, loss spikes, ranks that disagree
    stats.py    per-module gradient and parameter statistics
    trace.py    the module that produced the first NaN/Inf (forward/backward hooks), and a NaN
                made inside a forward (a dispatch mode over its operations, sampled steps)
    config.py   MonitorConfig and its validation

May import distdiag.report, distdiag.errors, distdiag.analyze (its spike score, so live
and offline agree), distdiag.check.config (dataclass_from_dict) and distdiag.runtime.settle
(its last all_reduce's tensor released before the process may end);
imports torch only when a monitor is built.
"""

from __future__ import annotations

from distdiag.monitor.config import MonitorConfig
from distdiag.monitor.monitor import TrainingMonitor

__all__ = ["TrainingMonitor", "MonitorConfig"]
