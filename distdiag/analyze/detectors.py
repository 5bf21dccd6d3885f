"""Detectors over one run's curves; each returns Detections (a Finding and the step it marks).

All of them are designed to stay quiet on healthy curves: warmup, learning-rate drops and
batch noise must produce nothing above `info`. They read smoothed curves (centred rolling
medians) so that a single noisy point never decides, and they stop at the first non-finite
value (after it the run is broken, and the NaN detector reports it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from distdiag.analyze.series import (
    Series,
    is_finite,
    mad_scale,
    median,
    rolling_median,
    smoothing_window,
    spike_score,
    spike_stands_out,
)
from distdiag.report.model import Finding

__all__ = [
    "Detection",
    "detect_nonfinite",
    "detect_spikes",
    "detect_divergence",
    "detect_plateau",
    "detect_grad_trend",
    "detect_overfit",
    "detect_repeats",
]


@dataclass
class Detection:
    finding: Finding
    step: int | None
    metric: str
    end_step: int | None = None


def _fmt(x: float) -> str:
    return f"{x:.4g}"


def _times(value: float, base: float) -> str:
    ratio = value / base if base else math.inf
    return f"{ratio:.1f}x" if ratio < 1e4 else f"{ratio:.2g}x"


def detect_nonfinite(series: list[Series]) -> list[Detection]:
    """The first NaN/Inf of each metric; the earliest one is the error, the others evidence."""
    firsts: list[tuple[int, str, float, int, int]] = []
    for s in series:
        bad = [i for i, v in enumerate(s.values) if not is_finite(v)]
        if bad:
            firsts.append((s.steps[bad[0]], s.name, s.values[bad[0]], len(bad), len(s) - bad[0]))
    if not firsts:
        return []
    # by step; on a tie the order of `series` (loss first) decides which one the finding names
    firsts.sort(key=lambda f: f[0])
    step, name, value, count, tail = firsts[0]
    kind = "NaN" if math.isnan(value) else "Inf"
    others = ", ".join(f"{n} from step {st}" for st, n, *_ in firsts[1:6])
    lead = next((s for s in series if s.name == name), None)
    before = ""
    if lead is not None:
        prev = [(st, v) for st, v in zip(lead.steps, lead.values, strict=True) if st < step and is_finite(v)][-3:]
        if prev:
            before = "; last finite values " + ", ".join(f"{_fmt(v)} (step {st})" for st, v in prev)
    evidence = f"{count} of the {tail} points of {name} from step {step} on are non-finite{before}"
    if others:
        evidence += f"; also non-finite: {others}"
    grad_first = next((f for f in firsts if "grad" in f[1].lower()), None)
    fix = (
        "Find the first module that produced it: run with distdiag.TrainingMonitor (it traces "
        "forward and backward hooks once it sees a non-finite value); lower the learning rate, "
        "clip gradients, and check the data at that step."
    )
    if grad_first is not None and grad_first[0] <= step and "grad" not in name.lower():
        when = f"first, at step {grad_first[0]}" if grad_first[0] < step else "at the same step"
        evidence += f"; the gradient norm ({grad_first[1]}) was non-finite {when}"
    finding = Finding(
        severity="error",
        issue=f"{name} became {kind} at step {step}",
        evidence=evidence,
        fix=fix,
        confidence=1.0,
    )
    return [Detection(finding, step, name)]


def _spike_events(s: Series, factor: float, window: int, min_history: int) -> list[tuple[int, int, float, float]]:
    """(first index, peak index, peak value, baseline) of each run of spiking points that is
    more than one batch's noise (series.spike_stands_out)."""
    events: list[tuple[int, int, float, float]] = []
    vals = s.values
    i = min_history
    while i < len(vals):
        hist = vals[max(0, i - window) : i]
        spike, base, _ = spike_score(hist, vals[i], factor)
        if not spike:
            i += 1
            continue
        start, peak = i, i
        # the spike lasts while points stay above the same baseline's threshold
        while i + 1 < len(vals) and spike_score(hist, vals[i + 1], factor)[0]:
            i += 1
            if vals[i] > vals[peak]:
                peak = i
        if spike_stands_out(vals[max(0, start - 6 * window) : start], vals[start : i + 1], factor, window):
            events.append((start, peak, vals[peak], base))
        i += 1
    return events


def detect_spikes(
    loss: Series,
    grad: Series | None,
    *,
    factor: float,
    window: int = 20,
    lookback: int = 10,
    until_step: int | None = None,
) -> list[Detection]:
    """Loss spikes against a rolling median of the `window` points before; for each, whether
    the gradient norm spiked in the `lookback` steps before (or at) it."""
    s = loss.finite_prefix()
    if until_step is not None:
        keep = [i for i, st in enumerate(s.steps) if st < until_step]
        s = Series(s.name, [s.steps[i] for i in keep], [s.values[i] for i in keep])
    min_history = min(window, 10)
    out: list[Detection] = []
    grad_events = []
    if grad is not None:
        g = grad.finite_prefix()
        grad_events = [(g.steps[a], g.values[p], base) for a, p, _, base in _spike_events(g, factor, window, min_history)]
    for start, peak, value, base in _spike_events(s, factor, window, min_history):
        step = s.steps[start]
        pre = [e for e in grad_events if step - lookback <= e[0] <= step]
        evidence = f"{s.name} {_fmt(value)} at step {s.steps[peak]} vs a median of {_fmt(base)} over the {window} points before ({_times(value, base)})"
        if pre:
            gstep, gval, gbase = pre[0]
            evidence += f"; the gradient norm spiked first: {_fmt(gval)} at step {gstep} vs a median of {_fmt(gbase)}"
            fix = "Clip gradients (torch.nn.utils.clip_grad_norm_) near the usual gradient norm, lower the learning rate or lengthen warmup; check the batch at that step."
        elif grad is not None:
            evidence += f"; no gradient-norm spike in the {lookback} steps before"
            fix = "A loss spike without a gradient spike points at the data: inspect the batch at that step (a corrupt or out-of-distribution sample)."
        else:
            fix = "Log the gradient norm too (distdiag.TrainingMonitor does) to tell an optimiser instability from a bad batch; inspect the batch at that step."
        out.append(
            Detection(
                Finding(
                    severity="warning",
                    issue=f"{s.name} spiked at step {step} to {_fmt(value)} ({_times(value, base)} its recent median {_fmt(base)})",
                    evidence=evidence,
                    fix=fix,
                    confidence=0.8 if pre or grad is None else 0.7,
                ),
                step,
                s.name,
            )
        )
    return out


def _smoothed(loss: Series, min_points: int) -> tuple[Series, int, list[float], float] | None:
    """(finite prefix, smoothing window, its rolling median, starting level), or None when too short."""
    s = loss.finite_prefix()
    n = len(s)
    if n < min_points:
        return None
    w = smoothing_window(n)
    return s, w, rolling_median(s.values, w), median(s.values[: max(3, w)])


def _held_above_noise(values: list[float], sm: list[float], i: int, j: int, w: int, floor: float) -> bool:
    """Whether the points from the crossing i on are a rise and not batch noise: at least 4 of
    them, their raw median above `floor` (best + threshold: near the end the centred median
    shrinks to a few raw batches, so the smoothed curve alone is not enough), and that median
    above the median of the points before the onset j (as many, two windows at least) by four
    standard errors of the difference, from the batch-to-batch scatter around the smoothed
    curve (robustly: the lowest point of a noisy smoothed curve is itself low by noise). Not a
    whole window of points: a rise in the last 20 of 600 steps is found."""
    held = values[i:]
    if len(held) < 4 or median(held) <= floor:
        return False
    before = values[max(0, j - max(len(held), 2 * w)) : j + 1]
    sigma = mad_scale([v - m for v, m in zip(values, sm, strict=True)], 0.0)
    se = 1.2533 * sigma * math.sqrt(1 / len(held) + 1 / len(before))
    return median(held) - median(before) > 4 * se


def detect_divergence(loss: Series) -> list[Detection]:
    """The loss rises and stays up after a healthy start. Marks the step the rise began."""
    smooth = _smoothed(loss, 20)
    if smooth is None:
        return []
    s, w, sm, start_level = smooth
    n = len(s)
    suffix_min = sm[:]
    for i in range(n - 2, -1, -1):
        suffix_min[i] = min(sm[i], suffix_min[i + 1])
    best, best_i = sm[0], 0
    for i in range(1, n):
        if sm[i] < best:
            best, best_i = sm[i], i
            continue
        threshold = max(0.25 * (start_level - best), 0.2 * abs(best), 1e-12)
        if sm[i] - best <= threshold:
            continue
        # sustained: it never comes back within half the threshold of the best
        if suffix_min[i] - best <= 0.5 * threshold:
            continue
        # the rise began where the curve last left the best level (the argmin of a flat,
        # noisy bottom would pick a random point of it)
        j = next((k for k in range(i, best_i - 1, -1) if sm[k] <= best + 0.1 * threshold), best_i)
        if not _held_above_noise(s.values, sm, i, j, w, best + threshold):
            continue
        onset = s.steps[j]
        healthy = start_level - best > 0.05 * abs(start_level)
        end_value = s.values[-1]
        broke = n < len(loss)
        return [
            Detection(
                Finding(
                    severity="error",
                    issue=(
                        f"{s.name} diverged from step {onset}: from {_fmt(best)} up to {_fmt(max(sm[i:]))}"
                        + (" after a healthy start" if healthy else " (it never decreased)")
                    ),
                    evidence=(
                        f"smoothed {s.name} (rolling median of {w} points) was lowest at step {s.steps[best_i]} ({_fmt(best)}), left that level at step {onset}, "
                        f"rose past {_fmt(best + threshold)} at step {s.steps[i]} and stayed up; last finite value {_fmt(end_value)}"
                        + (f"; it turned non-finite at step {loss.steps[n]}" if broke else "")
                    ),
                    fix="Lower the learning rate (or lengthen warmup), clip gradients, and resume from a checkpoint before the onset.",
                    confidence=0.85 if healthy else 0.7,
                ),
                onset,
                s.name,
            )
        ]
    return []


def detect_plateau(loss: Series, *, tol: float = 0.05, min_frac: float = 0.2, min_points: int = 20) -> list[Detection]:
    """Stretches where the smoothed loss stays within `tol` of the run's total progress.

    Flat from the start (it never learned) is a warning. A flat stretch after progress is
    reported as info: a healthy run converging before a learning-rate drop looks the same
    as a stall, so only the user can tell them apart.
    """
    smooth = _smoothed(loss, max(min_points, 20))
    if smooth is None:
        return []
    s, w, sm, start_level = smooth
    n = len(s)
    progress = start_level - min(sm)
    steps, values = s.steps, s.values
    if n > 2000:  # the scan is O(n * min_len): thin the smoothed curve, it changes slowly
        stride = -(-n // 2000)
        steps, values, sm = steps[::stride], values[::stride], sm[::stride]
        n, w = len(sm), max(1, w // stride)
    scale = max(progress, 0.02 * abs(start_level), 1e-12)
    # the smoothed curve still wobbles by the batch noise / sqrt(window): flat within that is flat
    band = max(tol * scale, 6.0 * 1.25 * mad_scale([v - m for v, m in zip(values, sm, strict=True)]) / math.sqrt(w))
    min_len = max(min_points, int(min_frac * n))
    out: list[Detection] = []
    a = 0
    while a < n - min_len:
        lo = hi = sm[a]
        b = a
        while b + 1 < n:
            nlo, nhi = min(lo, sm[b + 1]), max(hi, sm[b + 1])
            if nhi - nlo > band:
                break
            lo, hi, b = nlo, nhi, b + 1
        if b - a + 1 < min_len:
            a += 1
            continue
        from_start = a <= w // 2
        never_learned = progress <= max(0.02 * abs(start_level), band)
        # a log whose first point comes after updates (Lightning logs from step 49, the HF
        # Trainer from logging_steps) cannot tell "never learned" from "learned before it"
        unseen_start = from_start and never_learned and steps[0] > 1
        severity = "warning" if from_start and never_learned and not unseen_start else "info"
        issue, fix = _plateau_words(s.name, median(values[a : b + 1]), steps, a, b, severity, unseen_start, b == n - 1)
        evidence = (
            f"{b - a + 1} of {n} points within {_fmt(hi - lo)} "
            f"({100 * (hi - lo) / scale:.1f}% of the run's total progress {_fmt(progress)})"
        )
        out.append(Detection(Finding(severity, issue, evidence, fix=fix, confidence=0.8 if severity == "warning" else 0.5), steps[a], s.name, steps[b]))
        a = b + 1
    return out


def _plateau_words(name: str, level: float, steps: list[int], a: int, b: int, severity: str, unseen_start: bool, at_end: bool) -> tuple[str, str]:
    """The issue and fix of a plateau from step index a to b."""
    issue = (
        f"{name} is flat at {_fmt(level)} from step {steps[a]} to step {steps[b]}"
        + (" (it never decreased)" if severity == "warning" else "")
        + (f": converged before the first logged step {steps[0]}, or never learned (the log has no earlier point)" if unseen_start else "")
    )
    fix = (
        "Check that parameters are updated (learning rate not zero, optimizer holds the model's parameters, "
        "no detach in the graph) and that labels match inputs."
        if severity == "warning"
        else "Compare with the loss expected at initialisation (ln(classes) for cross-entropy): near it, the run never learned."
        if unseen_start
        else ("Converged, or stalled: " if at_end else "A stall that later resumed, or convergence before a learning-rate drop: ")
        + "compare with the learning-rate schedule."
    )
    return issue, fix


def detect_grad_trend(grad: Series, loss: Series | None, *, explode_factor: float = 100.0, vanish_factor: float = 1e-3, vanish_abs: float = 1e-8, explode_abs: float = 1e3) -> list[Detection]:
    """Gradient norm growing or shrinking by orders of magnitude over the run."""
    g = grad.finite_prefix()
    n = len(g)
    if n < 10:
        return []
    k = max(3, n // 10)
    early, late = median(g.values[:k]), median(g.values[-k:])
    sm = rolling_median(g.values, smoothing_window(n))
    out: list[Detection] = []
    if early > 0 and (late / early >= explode_factor or (late > explode_abs and early <= explode_abs)):
        edge = early * math.sqrt(max(late / early, 1.0))
        onset = next((g.steps[i] for i, v in enumerate(sm) if v > max(edge, early * 10)), g.steps[-k])
        out.append(
            Detection(
                Finding(
                    "warning",
                    f"{g.name} explodes: grew {late / early:.0f}x, from {_fmt(early)} to {_fmt(late)} (past 10x its early level from step {onset})",
                    f"median of the first {k} points {_fmt(early)}, of the last {k} points {_fmt(late)}",
                    fix="Clip gradients, lower the learning rate, check normalisation layers and the loss scale (fp16).",
                    confidence=0.8,
                ),
                onset,
                g.name,
            )
        )
    elif late < vanish_abs or (early > 0 and late / early <= vanish_factor):
        onset = next((g.steps[i] for i, v in enumerate(sm) if v < early / 10), g.steps[-k])
        learning = False
        if loss is not None:
            lp = loss.finite_prefix()
            if len(lp) >= 10:
                kl = max(3, len(lp) // 10)
                le, ll = median(lp.values[:kl]), median(lp.values[-kl:])
                learning = le - ll > 0.5 * abs(le)
        out.append(
            Detection(
                Finding(
                    "info" if learning else "warning",
                    f"{g.name} vanishes: fell to {_fmt(late)} from {_fmt(early)} (below a tenth of its early level from step {onset})"
                    + (" while the loss converged" if learning else " while the loss did not improve"),
                    f"median of the first {k} points {_fmt(early)}, of the last {k} points {_fmt(late)}",
                    fix="If the loss is still high: check for saturated activations, dead ReLUs, a detached graph or a too small learning rate.",
                    confidence=0.5 if learning else 0.75,
                ),
                onset,
                g.name,
            )
        )
    return out


def detect_overfit(train: Series, val: Series, *, tol: float = 0.05) -> list[Detection]:
    """Validation loss turning up while the training loss keeps falling: a gap that grows."""
    v = val.finite_prefix()
    t = train.finite_prefix()
    if len(v) < 4 or len(t) < 10:
        return []
    t_sm = Series(t.name, t.steps, rolling_median(t.values, smoothing_window(len(t))))
    vals = v.values
    k = min(range(len(vals)), key=lambda i: vals[i])
    vmin = vals[k]
    tail = vals[k + 1 :]
    margin = tol * max(abs(vmin), 1e-12)
    if len(tail) < 2 or tail[-1] - vmin <= margin or tail[-2] - vmin <= 0.5 * margin:
        return []
    t_at_min = t_sm.value_at_or_before(v.steps[k])
    t_end = t_sm.value_at_or_before(v.steps[-1])
    if t_at_min is None or t_end is None or t_end >= t_at_min:
        return []  # the training loss rose too: not overfitting (see divergence)
    gap0, gap1 = vmin - t_at_min, vals[-1] - t_end
    if gap1 - gap0 <= margin:
        return []
    return [
        Detection(
            Finding(
                "warning",
                f"{v.name} rose from {_fmt(vmin)} at step {v.steps[k]} to {_fmt(vals[-1])} at step {v.steps[-1]} while {t.name} fell: overfitting since step {v.steps[k]}",
                f"train/validation gap grew from {_fmt(gap0)} to {_fmt(gap1)}; {t.name} went {_fmt(t_at_min)} -> {_fmt(t_end)}",
                fix="Stop at (or keep the checkpoint of) that step, add data or augmentation, regularise (weight decay, dropout).",
                confidence=0.75,
            ),
            v.steps[k],
            v.name,
        )
    ]


def detect_repeats(name: str, repeats: list[tuple[int, float, float]], others: list[str]) -> list[Detection]:
    """Steps of `name` logged twice (a resumed run logs the steps since its checkpoint again):
    info, with the jump between the two values; a warning when the later values part from the
    first by more than 10% and the batch noise (the resume did not continue the run)."""
    pairs = [(st, a, b) for st, a, b in repeats if is_finite(a) and is_finite(b)]
    if not repeats:
        return []
    k = len(repeats)
    span = f"step {repeats[0][0]}" if k == 1 else f"{k} steps, {repeats[0][0]} to {repeats[-1][0]}"
    st0, a0, b0 = repeats[0]
    evidence = f"at step {st0} first {_fmt(a0)}, then {_fmt(b0)}"
    rel = 0.0
    if pairs:
        med_a, med_b = median([a for _, a, _ in pairs]), median([b for _, _, b in pairs])
        rel = (med_b - med_a) / abs(med_a) if med_a else (math.inf if med_b else 0.0)
        big = max(pairs, key=lambda p: abs(p[2] - p[1]))
        evidence += (
            f"; over the repeated steps the median went {_fmt(med_a)} -> {_fmt(med_b)} ({rel:+.1%}); "
            f"largest jump at step {big[0]}: {_fmt(big[1])} -> {_fmt(big[2])}"
        )
        noise = mad_scale([a for _, a, _ in pairs]) / abs(med_a) if med_a else 0.0
        parted = abs(rel) > max(0.1, 3.0 * noise / math.sqrt(len(pairs)))
    else:
        parted = False
    if others:
        evidence += f"; also logged twice: {', '.join(others[:6])}"
    issue = f"{name} was logged twice at {span}: a resumed run (or two runs in one log); the later values are analysed"
    fix = "If the log holds two different runs, split it and pass both to distdiag analyze to compare them."
    if parted:
        issue += f"; they are {rel:+.0%} off the first values at the same steps"
        fix = (
            "The resumed run does not continue the first: check that the checkpoint restored the optimizer and "
            "learning-rate scheduler state, the data position (sampler epoch and offset) and the RNG states. " + fix
        )
    finding = Finding("warning" if parted else "info", issue, evidence, fix=fix, confidence=0.7 if parted else 0.6)
    return [Detection(finding, st0, name, repeats[-1][0])]
