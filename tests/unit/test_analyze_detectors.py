"""distdiag analyze on synthetic curves: each known event found at its step, clean curves quiet."""

from __future__ import annotations

import json
import math
import re

import pytest

from distdiag.analyze import AnalyzeConfig, analyze, load_run
from distdiag.analyze.series import Run, Series, median, rolling_median
from tests.unit.analyze_curves import clean_curve, grad_curve, steep_curve

SEVERE = ("warning", "error", "critical")


def _run(label: str = "run", **series: list[float]) -> Run:
    run = Run(label=label, source=f"{label}.jsonl")
    for name, values in series.items():
        run.series[name] = Series(name, list(range(len(values))), list(values))
    return run


def _events(report, probe: str) -> list[dict]:
    p = report.probe(probe)
    return [e for e in p.details["events"] if e["severity"] in SEVERE] if p else []


def _severe(report) -> list[str]:
    return [f"{name}: {f.issue}" for name, f in report.findings("warning")]


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_clean_synthetic_curves_give_nothing_above_info(seed):
    """Clean curves (LR drops, 8% noise, flat grad norm) of several seeds: no warning or error."""
    report = analyze([_run(loss=clean_curve(seed=seed), grad_norm=grad_curve(seed=seed + 10))])
    assert _severe(report) == []


def test_spike_found_at_its_step_with_the_preceding_grad_spike():
    """A 4x loss spike at step 300 after a grad-norm spike at 297 is found, with that evidence."""
    loss, grad = clean_curve(), grad_curve()
    loss[300] *= 4
    grad[297] = 25.0
    report = analyze([_run(loss=loss, grad_norm=grad)])
    events = _events(report, "spikes")
    assert [e["step"] for e in events] == [300]
    finding = report.probe("spikes").findings[0]
    assert "gradient norm spiked first" in finding.evidence and "step 297" in finding.evidence
    assert _severe(report) == [f"spikes: {finding.issue}"]


@pytest.mark.parametrize("step", [45, 60, 80, 100])
def test_lone_spike_early_in_a_fast_decay_is_found(step):
    """A loss 6x its recent median for one step, a 20x grad-norm spike 3 steps before, while the
    curve still falls fast: found (the worst batch of the 100 steps before is far above the level)."""
    loss, grad = steep_curve(), grad_curve()
    loss[step] = 6 * median(loss[step - 20 : step])
    grad[step - 3] = 20.0
    report = analyze([_run(loss=loss, grad_norm=grad)])
    assert [e["step"] for e in _events(report, "spikes")] == [step]
    assert "gradient norm spiked first" in report.probe("spikes").findings[0].evidence


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_fast_decay_without_spike_is_quiet(seed):
    """The healthy twin: the same fast decay with its batch noise gives nothing above info."""
    assert _severe(analyze([_run(loss=steep_curve(seed=seed), grad_norm=grad_curve(seed=seed + 10))])) == []


def test_spike_without_grad_spike_points_at_the_data():
    """A loss spike with a quiet gradient norm says so and points at the batch."""
    loss = clean_curve()
    loss[450] *= 5
    report = analyze([_run(loss=loss, grad_norm=grad_curve())])
    finding = report.probe("spikes").findings[0]
    assert "step 450" in finding.issue and "no gradient-norm spike" in finding.evidence
    assert "batch" in finding.fix


@pytest.mark.parametrize("onset", [250, 400])
def test_divergence_found_from_its_step(onset):
    """The loss rising exponentially from step s after a healthy start: divergence near s."""
    loss = [v if i < onset else v * math.exp((i - onset) / 40) for i, v in enumerate(clean_curve())]
    report = analyze([_run(loss=loss)])
    events = _events(report, "divergence")
    assert len(events) == 1 and abs(events[0]["step"] - onset) <= 15, events
    assert report.probe("divergence").findings[0].severity == "error"
    assert report.probe("spikes") is not None
    assert _events(report, "spikes") == []  # the climb is one divergence, not a hundred spikes


@pytest.mark.parametrize("seed", range(5))
def test_a_divergence_in_the_last_20_of_600_steps_is_found(seed):
    """A rise over the run's last 20 points (x e per 10 steps), shorter than the 25-point smoothing
    window: still one divergence (the evidence asked for is 4 points past the threshold, not a window)."""
    curve = clean_curve(seed=seed)
    onset = len(curve) - 20
    loss = [v if i < onset else v * math.exp((i - onset) / 10) for i, v in enumerate(curve)]
    assert len(_events(analyze([_run(loss=loss)]), "divergence")) == 1


@pytest.mark.parametrize("kind", [math.nan, math.inf])
def test_nonfinite_found_at_its_step(kind):
    """NaN (or Inf) from step 420: one error naming step 420, and the last finite values."""
    loss = [v if i < 420 else kind for i, v in enumerate(clean_curve())]
    report = analyze([_run(loss=loss)])
    events = _events(report, "nonfinite")
    assert [e["step"] for e in events] == [420]
    f = report.probe("nonfinite").findings[0]
    assert ("NaN" if math.isnan(kind) else "Inf") in f.issue and "step 419" in f.evidence
    assert [name for name, _ in report.findings("warning")] == ["nonfinite"]


def test_grad_norm_nonfinite_first_is_said():
    """The grad norm turning NaN before the loss is part of the evidence."""
    loss = [v if i < 310 else math.nan for i, v in enumerate(clean_curve())]
    grad = [v if i < 305 else math.nan for i, v in enumerate(grad_curve())]
    f = analyze([_run(loss=loss, grad_norm=grad)]).probe("nonfinite").findings[0]
    assert "step 305" in f.issue and "grad_norm" in f.issue


def test_plateau_from_the_start_is_a_warning():
    """A loss that never decreases (flat at 2.3 with noise) is a plateau warning from step 0."""
    loss = [2.3 * v / 0.5 for v in clean_curve(seed=5)[400:]] * 3  # flat, noisy
    report = analyze([_run(loss=loss)])
    events = _events(report, "plateau")
    assert events and events[0]["step"] <= 15, events


def test_plateau_in_the_middle_found_at_its_step():
    """Decrease until 150, flat until 350, decrease again: a flat stretch reported from ~150."""
    loss = []
    for t in range(500):
        level = 4 - 2 * min(t, 150) / 150 - (1.5 * (t - 350) / 150 if t > 350 else 0)
        loss.append(level * (1 + 0.02 * math.sin(t * 1.7)))
    plateau = analyze([_run(loss=loss)]).probe("plateau")
    starts = [(e["step"], e["end_step"]) for e in plateau.details["events"]]
    assert any(abs(a - 150) <= 15 and abs(b - 350) <= 15 for a, b in starts), starts


def test_exploding_grad_trend():
    """A grad norm growing 1000x over the run is an exploding trend warning."""
    grad = [math.exp(i / 60) for i in range(500)]
    report = analyze([_run(loss=clean_curve(500), grad_norm=grad)])
    assert [f.severity for f in report.probe("grad_trend").findings] == ["warning"]
    assert "explodes" in report.probe("grad_trend").findings[0].issue


def test_overfitting_gap_found_at_the_validation_minimum():
    """Validation loss bottoming at step 300 then rising while train falls: overfit from 300."""
    train = clean_curve()
    val_steps = list(range(0, 600, 50))
    val = [0.9 + 3 * math.exp(-s / 80) + (0.002 * (s - 300) if s > 300 else 0) for s in val_steps]
    run = _run(loss=train)
    run.series["val_loss"] = Series("val_loss", val_steps, val)
    events = _events(analyze([run]), "overfit")
    assert [e["step"] for e in events] == [300]


def test_runs_part_at_the_first_step_beyond_tolerance():
    """Two runs equal (same noise) until 320, then one is 15% higher: they part at ~320."""
    a = clean_curve()
    b = [v if i < 320 else v * 1.15 for i, v in enumerate(a)]
    report = analyze([_run("gpu1", loss=a), _run("gpu8", loss=b)])
    events = _events(report, "compare")
    assert len(events) == 1 and abs(events[0]["step"] - 320) <= 5, events


def test_two_seeds_of_one_recipe_do_not_part():
    """Independent noise of two seeds of one curve stays within the tolerance (no warning)."""
    report = analyze([_run("a", loss=clean_curve(seed=1)), _run("b", loss=clean_curve(seed=2))])
    assert report.probe("compare") is not None
    assert _events(report, "compare") == []


def test_config_is_validated():
    """A spike factor <= 1 names the key, the value and the range."""
    with pytest.raises(ValueError, match=r"analyze.spike_factor must be a finite number > 1, got 0.5"):
        AnalyzeConfig(spike_factor=0.5)


def test_rolling_median_is_centered():
    assert rolling_median([1, 100, 1, 1, 1], 3) == [50.5, 1, 1, 1, 1]


def _resumed_log(path, later_factor: float):
    """Steps 0-199, then a resume from step 150's checkpoint logging 150-399 again, its values
    `later_factor` times the first run's level."""
    first, later = clean_curve(seed=0), clean_curve(seed=1)
    with open(path, "w") as f:
        for t in range(200):
            f.write(json.dumps({"step": t, "loss": first[t], "grad_norm": 1.0}) + "\n")
        for t in range(150, 400):
            f.write(json.dumps({"step": t, "loss": later[t] * later_factor, "grad_norm": 1.0}) + "\n")
    return load_run(path)


def test_resume_that_restarts_off_the_curve_is_a_warning_with_the_jump(tmp_path):
    """A resume whose loss comes back 1.6x the first run's at the same steps (lost optimizer
    state): a warning naming the repeated steps and the jump between the two values."""
    report = analyze([_resumed_log(tmp_path / "r.jsonl", 1.6)])
    finding = report.probe("resume").findings[0]
    assert finding.severity == "warning" and "logged twice at 50 steps, 150 to 199" in finding.issue
    assert re.search(r"\+(5[5-9]|6[0-5])% off", finding.issue) and "at step 150 first" in finding.evidence and "optimizer" in finding.fix
    assert report.probe("resume").details["events"][0]["step"] == 150


def test_resume_that_continues_the_curve_is_info(tmp_path):
    """The healthy twin: a resume whose values continue the curve is said (info), nothing above."""
    report = analyze([_resumed_log(tmp_path / "r.jsonl", 1.0)])
    finding = report.probe("resume").findings[0]
    assert finding.severity == "info" and "logged twice at 50 steps" in finding.issue
    assert _severe(report) == []


def test_no_repeated_step_no_resume_probe():
    """A log with each step once has no resume row."""
    assert analyze([_run(loss=clean_curve(), grad_norm=grad_curve())]).probe("resume") is None


def _docs_regressor_losses(seed: int, shuffle: bool, lr_at: tuple[int, float] | None = None) -> list[float]:
    """The Lightning docs' example trained for real, in one process: 2 ranks' batches of 64 from
    each rank's own random data (indices r::2, as DistributedSampler splits them), gradients
    averaged as DDP does, SGD lr 0.05, 2 epochs of 32 steps; the logged loss is the ranks' mean.
    lr_at=(step, lr) sets the learning rate from that step on (a divergence made on purpose)."""
    import torch

    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    xs = [torch.randn(4096, 8) for _ in range(2)]
    idx = [torch.arange(r, 4096, 2) for r in range(2)]
    losses = []
    for step in range(64):
        if step % 32 == 0:
            order = [i[torch.randperm(len(i))] if shuffle else i for i in idx]
        if lr_at is not None and step == lr_at[0]:
            opt.param_groups[0]["lr"] = lr_at[1]
        opt.zero_grad()
        per_rank = []
        for x, o in zip(xs, order, strict=True):
            sel = o[(step % 32) * 64 : (step % 32 + 1) * 64]
            loss = torch.nn.functional.mse_loss(net(x[sel]), torch.sin(x[sel][:, :1]))
            (loss / 2).backward()
            per_rank.append(loss.item())
        opt.step()
        losses.append(sum(per_rank) / 2)
    return losses


@pytest.mark.parametrize(("seed", "shuffle"), [(9, False), (219, False), (289, False), (140, True)])
def test_a_short_healthy_run_whose_last_batches_are_noisy_is_no_divergence(seed, shuffle):
    """The docs' 64-step Lightning example at a low, noisy loss (batch scatter ~50% of the level):
    a rise of the 5-point median in the last 3-5 steps is batch noise, not a divergence (these
    seeds were reported as one, 1 run in 100)."""
    report = analyze([_run(loss=_docs_regressor_losses(seed, shuffle))])
    assert _events(report, "divergence") == []


@pytest.mark.parametrize("seed", range(4))
def test_a_divergence_in_the_last_eighth_of_a_short_run_is_still_found(seed):
    """The fault twin: the same run with the learning rate raised 20x at step 52 of 64: found."""
    report = analyze([_run(loss=_docs_regressor_losses(seed, False, lr_at=(52, 1.0)))])
    assert len(_events(report, "divergence")) == 1
