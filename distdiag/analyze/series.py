"""Metric series as read from logs, and the robust statistics the detectors share.

Pure Python on purpose: `distdiag analyze` must start fast and must not import torch or
require numpy. Logs of up to a few 10^5 points per metric analyse in about a second.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

__all__ = [
    "Series",
    "Run",
    "median",
    "mad_scale",
    "rolling_median",
    "smoothing_window",
    "spike_score",
    "spike_persists",
    "spike_stands_out",
    "is_finite",
]


def is_finite(x: float) -> bool:
    return not (math.isnan(x) or math.isinf(x))


@dataclass
class Series:
    """One metric of one run: (step, value) pairs sorted by step, duplicates kept last."""

    name: str
    steps: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.steps)

    def finite_prefix(self) -> Series:
        """The points before the first non-finite value (the run is broken after it)."""
        for i, v in enumerate(self.values):
            if not is_finite(v):
                return Series(self.name, self.steps[:i], self.values[:i])
        return self

    def value_at_or_before(self, step: int) -> float | None:
        i = bisect.bisect_right(self.steps, step) - 1
        return self.values[i] if i >= 0 else None


@dataclass
class Run:
    """All metrics read from one log (a file, or a TensorBoard log directory)."""

    label: str
    source: str
    series: dict[str, Series] = field(default_factory=dict)
    monitor_findings: list[dict] = field(default_factory=list)
    """Findings a distdiag TrainingMonitor wrote into the log while the run was going."""
    notes: list[str] = field(default_factory=list)
    """Things the reader tolerated (a truncated last line), shown on stderr."""
    format: str = ""
    """What wrote the log, as far as the reader can tell: jsonl, csv, lightning_csv, wandb_csv,
    hf_trainer_state, tfevents (the masking detector explains a trainer's known replacements)."""
    repeats: dict[str, list[tuple[int, float, float]]] = field(default_factory=dict)
    """Per metric, the steps logged more than once: (step, first value, last value) in step order
    (a resumed run logs the steps since its checkpoint again; `finish` keeps the last value)."""

    def add(self, name: str, step: int, value: float) -> None:
        self.series.setdefault(name, Series(name)).steps.append(step)
        self.series[name].values.append(value)

    def finish(self) -> None:
        """Sort each series by step; a step logged twice keeps its last value (a resumed run)."""
        for name, s in list(self.series.items()):
            if not s.steps:
                del self.series[name]
                continue
            if all(a < b for a, b in zip(s.steps, s.steps[1:], strict=False)):
                continue
            last: dict[int, float] = {}
            first: dict[int, float] = {}
            twice: set[int] = set()
            for st, v in zip(s.steps, s.values, strict=True):
                if st in last:
                    twice.add(st)
                else:
                    first[st] = v
                last[st] = v
            if twice:
                self.repeats[name] = [(st, first[st], last[st]) for st in sorted(twice)]
            ordered = sorted(last.items())
            s.steps = [st for st, _ in ordered]
            s.values = [v for _, v in ordered]


def _middle(ordered: list[float]) -> float:
    """The median of an already sorted, non-empty list."""
    n = len(ordered)
    mid = n // 2
    return ordered[mid] if n % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


def median(values: list[float]) -> float:
    return _middle(sorted(values)) if values else math.nan


def mad_scale(values: list[float], center: float | None = None) -> float:
    """Median absolute deviation scaled to a Gaussian's standard deviation (x1.4826)."""
    if not values:
        return math.nan
    c = median(values) if center is None else center
    return 1.4826 * median([abs(v - c) for v in values])


def smoothing_window(n: int) -> int:
    """An odd window for a curve of n points: about 4% of it, between 5 and 101 points."""
    w = max(5, min(101, n // 25))
    return w if w % 2 else w + 1


def rolling_median(values: list[float], window: int) -> list[float]:
    """Centred rolling median (window shrinks at the edges), O(n * window) with a sorted list.

    A median rather than a mean: one spike must not bend the trend the other detectors read.
    """
    n = len(values)
    if n == 0 or window <= 1:
        return list(values)
    half = window // 2
    out: list[float] = []
    buf = sorted(values[: min(n, half + 1)])
    lo, hi = 0, min(n, half + 1)  # buf holds values[lo:hi]
    for i in range(n):
        want_lo, want_hi = max(0, i - half), min(n, i + half + 1)
        while hi < want_hi:
            bisect.insort(buf, values[hi])
            hi += 1
        while lo < want_lo:
            del buf[bisect.bisect_left(buf, values[lo])]
            lo += 1
        out.append(_middle(buf))
    return out


def spike_score(history: list[float], x: float, factor: float) -> tuple[bool, float, float]:
    """Is x a spike against the history before it? Returns (spike, baseline median, robust z).

    Both must hold: x exceeds the baseline by `factor` (relative: a loss of 2 -> 4 at factor
    2) and by 6 robust standard deviations of the history, so that ordinary batch-to-batch
    noise of a small loss (0.01 -> 0.03) is not called a spike.
    """
    base = median(history)
    scale = max(mad_scale(history, base), 1e-3 * abs(base), 1e-12)
    z = (x - base) / scale
    return (x - base > (factor - 1.0) * abs(base) and z >= 6.0), base, z


def spike_persists(history: list[float], run: list[float], factor: float) -> bool:
    """Is a run of points above the spike threshold more than one batch's noise? It is when it
    lasts two points or more, or when its one point exceeds `factor` times the highest value of
    `history` (the callers pass the 5 x window points before: 100). The loss of a small batch is
    heavy-tailed: a hard batch of a converged small model reaches 3-6x the median and 6 robust
    sigmas (the docs' Lightning example has five such points in 128 steps), but it is one point,
    and it stays below twice the worst batch of the 100 before."""
    return len(run) >= 2 or (bool(run) and bool(history) and run[0] >= factor * max(history))


def _relative_peaks(before: list[float], window: int, span: int) -> list[float]:
    """Each of the last `span` points of `before` over the median of the `window` points before
    it (its own recent level), for points with at least 5 points before them and a positive level."""
    out: list[float] = []
    for j in range(max(0, len(before) - span), len(before)):
        hist = before[max(0, j - window) : j]
        if len(hist) < 5:
            continue
        level = median(hist)
        if level > 0:
            out.append(before[j] / level)
    return out


def spike_stands_out(before: list[float], run: list[float], factor: float, window: int) -> bool:
    """Is a run of points above the spike threshold more than one batch's noise? Like
    `spike_persists`, but a lone point is measured against the recent level, not the raw worst
    batch: it is a spike when its ratio to the median of the `window` points before it is
    `factor` times the highest such ratio among the 5 x window points before (each against its
    own window). The worst raw batch of 100 steps early in a decaying curve is the loss of 100
    steps ago, far above the current level: a 6x jump measured against it was missed. The ratio
    keeps the noise's tail in the bar (heavy-tailed batch losses at 3-4x their level make the bar
    6-8x), whatever the curve's trend. A level <= 0 (a loss that can be negative) falls back to
    the raw rule."""
    if len(run) >= 2:
        return True
    if not run or not before:
        return False
    level = median(before[-window:])
    if level <= 0:
        return spike_persists(before[-5 * window :], run, factor)
    peaks = _relative_peaks(before, window, 5 * window)
    return run[0] / level >= factor * max(peaks, default=1.0)
