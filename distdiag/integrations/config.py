"""DiagnosticsConfig: what the trainer callbacks switch on, and the budgets of their phases."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from distdiag.errors import ConfigError

__all__ = ["DiagnosticsConfig"]


def _positive(value: Any) -> bool:
    return isinstance(value, timedelta) and value.total_seconds() > 0


@dataclass
class DiagnosticsConfig:
    """The options of distdiag's trainer callbacks (Hugging Face, Lightning); keywords of the same names."""

    watchdog: bool = True
    """Arm distdiag's HangWatchdog for the training run (it reuses the one `-m distdiag.watch` armed)."""
    timeout: timedelta | None = None
    """No progress on a rank for this long is a hang; None: DISTDIAG_WATCHDOG_TIMEOUT_S, else 5 minutes.
    It must exceed the slowest healthy step, the first one (warm-up, compilation) included."""
    action: str | None = None
    """abort | raise | report (docs/watchdog.md); None: DISTDIAG_WATCHDOG_ACTION, else abort."""
    dump_dir: str | None = None
    """Where hang-report.json goes; None: DISTDIAG_WATCHDOG_DUMP_DIR, else OUTPUT_DIR/hang-report."""
    eval_timeout: timedelta = timedelta(minutes=30)
    """Budget of an evaluation: peers waiting on a rank that evaluates are not hung until it runs out."""
    save_timeout: timedelta = timedelta(minutes=30)
    """Budget of a checkpoint save."""
    log_timeout: timedelta = timedelta(minutes=5)
    """Budget of a logging step (the trainer's loggers may upload: W&B, MLflow, the Hub)."""
    monitor: bool = True
    """Run distdiag's TrainingMonitor after backward, before each optimizer step."""
    every: int = 10
    """The monitor looks every this many optimizer steps (one small all_reduce per look)."""
    metrics_log: str | None = "distdiag-metrics.jsonl"
    """The monitor's JSONL log (rank 0), relative to the trainer's log directory; None: no file."""
    skip_nonfinite: bool = True
    """Skip an update whose gradients hold NaN/Inf (as GradScaler does), so that the parameters stay
    finite and the monitor can name the module that produced it. Costs one norm over the gradients
    per step; False keeps the trainer's own behaviour (it applies the update: parameters turn NaN)."""
    monitor_options: dict[str, Any] = field(default_factory=dict)
    """Overrides of distdiag.monitor.MonitorConfig, e.g. {"spike_factor": 3, "trace": "always"}."""

    def __post_init__(self) -> None:
        if self.timeout is not None and not _positive(self.timeout):
            raise ConfigError(f"integrations.timeout must be a positive timedelta or None, got {self.timeout!r}")
        for key in ("eval_timeout", "save_timeout", "log_timeout"):
            if not _positive(getattr(self, key)):
                raise ConfigError(f"integrations.{key} must be a positive timedelta, got {getattr(self, key)!r}")
        if not isinstance(self.every, int) or isinstance(self.every, bool) or self.every < 1:
            raise ConfigError(f"integrations.every must be an int >= 1, got {self.every!r}")
        if self.metrics_log is not None and (not isinstance(self.metrics_log, str) or not self.metrics_log):
            raise ConfigError(f"integrations.metrics_log must be a non-empty path or None, got {self.metrics_log!r}")
        if not isinstance(self.monitor_options, dict):
            raise ConfigError(f"integrations.monitor_options must be a dict of MonitorConfig fields, got {self.monitor_options!r}")
        if "every" in self.monitor_options:
            raise ConfigError("integrations.monitor_options: pass every= to the callback itself, not in monitor_options")

    def budget(self, phase: str) -> timedelta:
        """The time budget of a phase the callbacks declare (evaluation, checkpoint, logging)."""
        return {"evaluation": self.eval_timeout, "checkpoint": self.save_timeout, "logging": self.log_timeout}[phase]
