"""Training-health monitor for the training loop (distdiag.TrainingMonitor)."""

from __future__ import annotations

from distdiag.monitor.config import MonitorConfig
from distdiag.monitor.monitor import TrainingMonitor

__all__ = ["TrainingMonitor", "MonitorConfig"]
