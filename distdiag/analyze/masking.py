"""Non-finite values that reached the log masked or replaced, and the steps they hide.

Trainers filter what they log. The Hugging Face Trainer (`logging_nan_inf_filter=True`, its
default) replaces a NaN/Inf loss by the mean of the logging window's finite losses so far, which
is exactly 0 when the whole window was non-finite: the log shows a finite loss while the gradient
norm it logs beside it (computed by clipping) is NaN. Some loggers and exporters drop non-finite
points instead: the metric stops while the others go on.

`detect_masked` reports each case; the steps where the loss is shown to be masked (a finite loss
beside a non-finite gradient norm, logged as exactly 0 or as the previous value) are returned so
that the other detectors read them as the NaN they were.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from distdiag.analyze.detectors import Detection
from distdiag.analyze.series import Series, is_finite, median
from distdiag.report.model import Finding

__all__ = ["Masking", "detect_masked"]

_HF_NOTE = ("the Hugging Face Trainer does this by default (logging_nan_inf_filter=True): a NaN/Inf loss is replaced by "
            "the mean of the logging window's finite losses, 0 when none was finite")


@dataclass
class Masking:
    detections: list[Detection] = field(default_factory=list)
    steps: set[int] = field(default_factory=set)
    """Steps of the loss that are NaN in truth (the other detectors read them as NaN)."""


def _fmt(x: float) -> str:
    return f"{x:.4g}"


def _hidden_by_companion(loss: Series, companions: list[Series], run_format: str) -> tuple[list[Detection], set[int]]:
    values = dict(zip(loss.steps, loss.values, strict=True))
    for comp in companions:
        bad = [st for st, v in zip(comp.steps, comp.values, strict=True) if not is_finite(v)]
        hidden = [st for st in bad if st in values and is_finite(values[st])]
        if not hidden:
            continue
        previous = {st: prev for prev, st in zip(loss.values, loss.steps[1:], strict=False)}
        replaced = [st for st in hidden if values[st] == 0.0 or values[st] == previous.get(st)]
        first = hidden[0]
        before = [(st, v) for st, v in zip(loss.steps, loss.values, strict=True) if st < first and is_finite(v)][-3:]
        shown = ", ".join(f"{_fmt(values[st])} (step {st})" for st in hidden[:4])
        evidence = (f"{comp.name} is non-finite at {len(bad)} step(s) from step {bad[0]}; {loss.name} is logged finite at "
                    f"{len(hidden)} of them: {shown}" + (" ..." if len(hidden) > 4 else ""))
        if before:
            evidence += "; before: " + ", ".join(f"{_fmt(v)} (step {st})" for st, v in before)
        known = run_format == "hf_trainer_state" or (loss.name.startswith("train/") and comp.name == "train/grad_norm")
        fix = ("Treat the run as broken from step " + str(first) + ": set logging_nan_inf_filter=False to log the real "
               "values, and run distdiag's trainer callback (distdiag.integrations) to name the module that produced "
               "the first NaN.")
        if replaced:
            finding = Finding(
                "error",
                f"{loss.name} hides non-finite values from step {first}: logged as "
                + ("exactly 0" if all(values[st] == 0.0 for st in replaced) else "a repeated or zero value")
                + f" at {len(replaced)} step(s) where {comp.name} is NaN/Inf",
                evidence + ("; " + _HF_NOTE if known else "; a trainer or logger replaced them (" + _HF_NOTE + ")"),
                fix=fix, confidence=0.9)
            return [Detection(finding, first, loss.name)], set(hidden)
        finding = Finding(
            "warning",
            f"{loss.name} stays finite at step {first} while {comp.name} is NaN/Inf: the loss may be masked",
            evidence + "; a NaN that arose in the backward pass alone would look the same; " + _HF_NOTE,
            fix=fix, confidence=0.5)
        return [Detection(finding, first, loss.name)], set()
    return [], set()


def _zero_drop(loss: Series) -> list[Detection]:
    """A loss that was clearly positive and is suddenly exactly 0: a logger's replacement value."""
    for i in range(1, len(loss)):
        if loss.values[i] == 0.0 and is_finite(loss.values[i - 1]) and loss.values[i - 1] >= 1e-3:
            zeros = sum(1 for v in loss.values[i:] if v == 0.0)
            finding = Finding(
                "warning",
                f"{loss.name} drops to exactly 0 at step {loss.steps[i]} from {_fmt(loss.values[i - 1])}: a non-finite value replaced by 0?",
                f"{zeros} of the {len(loss) - i} points from step {loss.steps[i]} on are exactly 0; a loss that converges "
                f"approaches 0, it does not jump there; {_HF_NOTE}",
                fix="Log the gradient norm beside the loss (NaN there confirms it) or disable the trainer's NaN filter.",
                confidence=0.6)
            return [Detection(finding, loss.steps[i], loss.name)]
    return []


def _stopped(loss: Series, others: list[Series]) -> list[Detection]:
    """The loss has no points after some step while other metrics go on: dropped non-finite values?"""
    if len(loss) < 5 or not others:
        return []
    gaps = sorted(b - a for a, b in zip(loss.steps, loss.steps[1:], strict=False))
    interval = max(1, median([float(g) for g in gaps]))
    last = loss.steps[-1]
    beyond = [s for s in others if len(s) and s.steps[-1] - last > 5 * interval]
    if not beyond:
        return []
    other = max(beyond, key=lambda s: s.steps[-1])
    span = other.steps[-1] - min(loss.steps[0], other.steps[0])
    if other.steps[-1] - last <= 0.1 * span:
        return []
    finding = Finding(
        "warning",
        f"{loss.name} is not logged after step {last} while {other.name} goes on to step {other.steps[-1]}",
        f"{loss.name} had a point every {interval:g} steps until step {last}; loggers and exporters that drop NaN/Inf "
        "(W&B charts and exports skip them) leave exactly this gap",
        fix="Check the raw log of the run around that step (or log the loss through a logger that keeps NaN, "
            "such as distdiag.TrainingMonitor's JSONL).",
        confidence=0.5)
    return [Detection(finding, last, loss.name)]


def detect_masked(loss: Series | None, companions: list[Series], others: list[Series], run_format: str = "") -> Masking:
    """companions: gradient norms (non-finite with the loss); others: every other metric of the run."""
    out = Masking()
    if loss is None or not len(loss):
        return out
    found, steps = _hidden_by_companion(loss, companions, run_format)
    out.detections += found
    out.steps |= steps
    if not found:
        out.detections += _zero_drop(loss)
    out.detections += _stopped(loss, others)
    return out
