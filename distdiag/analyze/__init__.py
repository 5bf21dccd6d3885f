"""Offline analysis of metric logs (`distdiag analyze PATH`): read, detect, report.

Pure Python: no torch import, no numpy; matplotlib only for --plot.
"""

from __future__ import annotations

from distdiag.analyze.core import DETECTORS, AnalyzeConfig, analyze, pick_metric
from distdiag.analyze.readers import LogFormatError, load_run
from distdiag.analyze.series import Run, Series

__all__ = ["AnalyzeConfig", "analyze", "load_run", "pick_metric", "LogFormatError", "Run", "Series", "DETECTORS"]
