"""Offline analysis of metric logs (`distdiag analyze PATH`): read, detect, report.

    readers.py    logs recognised by their content (JSONL, CSV, W&B export, Lightning CSV...)
    tfevents.py   TensorBoard event files, read without tensorboard or protobuf
    hf_state.py   the Hugging Face Trainer's trainer_state.json (log_history)
    values.py     what every reader shares: the one error type, values read defensively
    masking.py    non-finite values that reached the log masked or replaced
    series.py     Run and Series, and the robust statistics the detectors share
    detectors.py  divergence, NaN, spikes, plateaus...; core.py runs them into a Report
    compare.py    several runs side by side: the first step where they part
    plot.py       --plot: a PNG of the curves with the findings marked (matplotlib, optional)

Pure Python: no torch import, no numpy; matplotlib only for --plot. May import
distdiag.report and distdiag.errors only.
"""

from __future__ import annotations

from distdiag.analyze.core import DETECTORS, AnalyzeConfig, analyze, pick_metric
from distdiag.analyze.readers import LogFormatError, load_run
from distdiag.analyze.series import Run, Series

__all__ = ["AnalyzeConfig", "analyze", "load_run", "pick_metric", "LogFormatError", "Run", "Series", "DETECTORS"]
