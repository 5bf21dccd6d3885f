"""The Hugging Face Trainer's trainer_state.json: its `log_history` as metric series.

    {"global_step": 120, "log_history": [
        {"epoch": 0.1, "grad_norm": 1.2, "learning_rate": 5e-05, "loss": 2.31, "step": 10},
        {"epoch": 0.5, "eval_loss": 2.2, "eval_runtime": 0.4, "step": 50},
        {"distdiag_finding": {...}, "step": 60},           # distdiag.integrations.hf
        {"epoch": 1.0, "step": 120, "total_flos": ..., "train_loss": 2.0, "train_runtime": 31.2}],
     ...}

The Trainer writes it at every checkpoint (checkpoint-N/trainer_state.json, the whole history so
far) and with `trainer.save_state()` (OUTPUT_DIR/trainer_state.json). Its JSON keeps NaN as
`NaN`; but the Trainer's default `logging_nan_inf_filter=True` replaces a non-finite loss before
it is logged (distdiag.analyze.masking sees through that).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from distdiag.analyze.series import Run
from distdiag.analyze.values import LogFormatError, decode, monitor_finding, parse_json, read_log
from distdiag.analyze.values import number as _number
from distdiag.errors import shown

__all__ = ["is_trainer_state", "read_trainer_state", "read_trainer_state_file", "latest_checkpoint_state", "FINDING_KEY"]

FINDING_KEY = "distdiag_finding"
"""distdiag.integrations.hf.FINDING_KEY, repeated so that analyze never imports transformers."""
_NOT_METRICS = ("epoch", "step", "total_flos")


def is_trainer_state(doc: Any) -> bool:
    return isinstance(doc, dict) and "log_history" in doc


def _numeric_text(value: Any) -> bool:
    """A string that reads as a number ("2.31", "1e-4"): a metric written as text."""
    if not isinstance(value, str):
        return False
    try:
        float(value)
    except ValueError:
        return False
    return True


_METRIC_KEYS = ("loss", "grad_norm", "learning_rate")


def _is_metric(key: str) -> bool:
    """A key the analysis reads (a loss of any split, the gradient norm, the learning rate):
    any other key may hold the user's own text and is left out."""
    return any(word in key for word in _METRIC_KEYS)


def _label(path: Path) -> str:
    parent = path.parent
    return parent.parent.name if parent.name.startswith("checkpoint-") else parent.name or path.stem


def read_trainer_state(path: Path, doc: dict[str, Any], *, label: str | None = None) -> Run:
    run = Run(label=label or _label(path), source=str(path), format="hf_trainer_state")
    history = doc["log_history"]
    if not isinstance(history, list):
        raise LogFormatError(f"{path}: 'log_history' is a JSON {type(history).__name__}, expected a list of log entries")
    for i, entry in enumerate(history):
        where = f"{path}: log_history[{i}]"
        if not isinstance(entry, dict):
            raise LogFormatError(f"{where} is a JSON {type(entry).__name__}, expected an object")
        step = entry.get("step")
        if isinstance(step, bool) or not isinstance(step, int):
            raise LogFormatError(f"{where}: 'step' is {step!r}, expected the integer global step")
        if FINDING_KEY in entry:
            run.monitor_findings.append(monitor_finding(entry[FINDING_KEY], step, where))
            continue
        if "train_runtime" in entry:
            continue  # the closing summary: averages over the run, not a point of it
        for key, value in entry.items():
            if key in _NOT_METRICS or key.endswith(("_runtime", "_per_second")):
                continue
            num = _number(value)
            if num is not None:
                run.add(key, step, num)
            elif _numeric_text(value):
                # the Trainer writes numbers; one quoted would silently drop out of the analysis
                raise LogFormatError(f"{where}: {key!r} is the string {value!r}, expected a number (the Trainer writes numbers)")
            elif _is_metric(key) and value is not None:  # null: not measured at that step
                # a loss of "x" dropped, the run would pass on the points left: a PASS not earned
                raise LogFormatError(f"{where}: {key!r} is {shown(value)}, expected a number (the Trainer writes numbers)")
    run.finish()
    return run


def read_trainer_state_file(path: Path, *, label: str | None = None) -> Run:
    try:
        doc = parse_json(decode(path, read_log(path, "a Hugging Face trainer_state.json"), "a Hugging Face trainer_state.json"), str(path))
    except json.JSONDecodeError as exc:
        raise LogFormatError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}); expected a Hugging Face trainer_state.json") from None
    if not is_trainer_state(doc):
        raise LogFormatError(f"{path}: no 'log_history' list: not a Hugging Face trainer_state.json")
    return read_trainer_state(path, doc, label=label)


def latest_checkpoint_state(directory: Path) -> Path | None:
    """checkpoint-N/trainer_state.json of the highest N (it holds the whole history so far)."""
    found = []
    for state in directory.glob("checkpoint-*/trainer_state.json"):
        m = re.fullmatch(r"checkpoint-(\d+)", state.parent.name)
        if m:
            found.append((int(m.group(1)), state))
    return max(found)[1] if found else None
