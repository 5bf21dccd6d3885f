"""Several runs side by side (e.g. the 1-GPU and the 8-GPU log of one recipe): the first step
where their losses part beyond a tolerance."""

from __future__ import annotations

import math

from distdiag.analyze.detectors import Detection
from distdiag.analyze.series import Series, is_finite, mad_scale, rolling_median
from distdiag.report.model import Finding

__all__ = ["first_parting"]


def first_parting(
    ref_label: str,
    ref: Series,
    other_label: str,
    other: Series,
    *,
    tolerance: float,
    sustain: int = 3,
) -> Detection:
    """Compare on the steps both logged. Each curve is lightly smoothed (rolling median of
    about 2% of the points, odd, at most 51) so batch noise of runs with a different data order does
    not count; they part where the relative gap exceeds `tolerance` for `sustain` points in a row."""
    a = dict(zip(ref.steps, ref.values, strict=True))
    b = dict(zip(other.steps, other.values, strict=True))
    common = sorted(set(a) & set(b))
    name = ref.name if ref.name == other.name else f"{ref.name}/{other.name}"
    if len(common) < 2:
        return _too_few_common(ref_label, ref, other_label, other, len(common), name)
    w = _smoothing_width(len(common))
    ra, rb = [a[s] for s in common], [b[s] for s in common]
    va, vb = rolling_median(ra, w), rolling_median(rb, w)
    sustain = max(sustain, w)
    # batch noise left after smoothing: runs whose gap stays within ~4 of its standard
    # deviations have not parted, whatever the tolerance (two seeds of one recipe)
    noise = 4.0 * math.sqrt(_rel_noise(ra, va) ** 2 + _rel_noise(rb, vb) ** 2) / math.sqrt(w)
    j, worst_i = _scan(va, vb, max(tolerance, noise), sustain)
    largest = f"largest gap {_pct(va[worst_i], vb[worst_i])} at step {common[worst_i]}"
    if j is not None:
        step = common[j]
        return Detection(
            Finding(
                "warning",
                f"runs {ref_label} and {other_label} part at step {step}: {name} {a[step]:.4g} vs {b[step]:.4g}"
                f" ({_pct(va[j], vb[j])} apart, tolerance {100 * tolerance:.3g}%)",
                f"compared on {len(common)} common steps, smoothed over {w} point(s); the gap stays above the tolerance "
                f"(and the batch noise, {100 * noise:.2g}%) for "
                f"{sustain} logged steps from step {step}; {largest}",
                fix="Diff what changes between the runs from that step: learning-rate schedule and global batch size, "
                "data order/sharding, gradient accumulation and loss scaling, and the reduction (mean vs sum) across ranks.",
                confidence=0.8,
            ),
            step,
            name,
        )
    return Detection(
        Finding(
            "info",
            f"runs {ref_label} and {other_label} agree within {100 * tolerance:.3g}% on {name} over {len(common)} common steps",
            largest,
            confidence=0.9,
        ),
        None,
        name,
    )


def _too_few_common(ref_label: str, ref: Series, other_label: str, other: Series, n: int, name: str) -> Detection:
    """Nothing to compare: the runs share fewer than two logged steps."""
    return Detection(
        Finding(
            "info",
            f"runs {ref_label} and {other_label} share {n} logged step(s) of {name}: nothing to compare",
            f"{ref_label}: steps {ref.steps[0]}..{ref.steps[-1]}, {other_label}: steps {other.steps[0]}..{other.steps[-1]}",
            fix="Log the loss at the same steps in both runs.",
            confidence=1.0,
        ),
        None,
        name,
    )


def _smoothing_width(n: int) -> int:
    """The rolling-median window for n common points: about 2% of them, odd, 1 to 51."""
    w = max(1, min(51, n // 20))
    return w + (0 if w % 2 else 1)


def _gap(x: float, y: float) -> float:
    """Relative gap of two smoothed points; one non-finite and the other not is an infinite gap."""
    if not (is_finite(x) and is_finite(y)):
        return 0.0 if (not is_finite(x) and not is_finite(y)) else float("inf")
    return abs(x - y) / max(abs(x), abs(y), 1e-12)


def _scan(va: list[float], vb: list[float], threshold: float, sustain: int) -> tuple[int | None, int]:
    """The first index of `sustain` gaps in a row above threshold (None if none), and the index
    of the largest gap seen up to where the scan stopped."""
    run_len, worst, worst_i = 0, 0.0, 0
    for i, (x, y) in enumerate(zip(va, vb, strict=True)):
        gap = _gap(x, y)
        if gap > worst:
            worst, worst_i = gap, i
        run_len = run_len + 1 if gap > threshold else 0
        if run_len >= sustain:
            return i - sustain + 1, worst_i
    return None, worst_i


def _pct(x: float, y: float) -> str:
    if not (is_finite(x) and is_finite(y)):
        return "non-finite vs finite"
    return f"{100 * abs(x - y) / max(abs(x), abs(y), 1e-12):.1f}%"


def _rel_noise(raw: list[float], smooth: list[float]) -> float:
    """Robust standard deviation of the relative residuals around the smoothed curve."""
    res = [(x - s) / max(abs(s), 1e-12) for x, s in zip(raw, smooth, strict=True) if is_finite(x) and is_finite(s)]
    return mad_scale(res) if len(res) >= 5 else 0.0
