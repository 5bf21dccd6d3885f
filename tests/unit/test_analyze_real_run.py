"""Curves logged by a real tiny training run (warmup, LR drops, batch noise): nothing above info,
from the generic JSONL, from CSV and from the TrainingMonitor's own log; the monitor itself
finds nothing above info either (the healthy twin of the monitor tests)."""

from __future__ import annotations

import csv
import json

import pytest
import torch

from distdiag.analyze import analyze, load_run
from distdiag.analyze.series import Run, Series
from distdiag.monitor import TrainingMonitor


def _train(tmp_path, seed: int, steps: int = 300):
    torch.manual_seed(seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 shared cores: threads would only contend
    try:
        return _loop(tmp_path, steps)
    finally:
        torch.set_num_threads(threads)


def _loop(tmp_path, steps: int):
    teacher = torch.nn.Linear(16, 4)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)

    def lr_at(step: int) -> float:
        warm = min(1.0, (step + 1) / 20)
        return warm * (1.0 if step < 120 else 0.3 if step < 210 else 0.1)

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    val_x = torch.randn(512, 16)
    val_y = torch.multinomial(torch.softmax(teacher(val_x) * 3, dim=1), 1).squeeze(1)
    monitor = TrainingMonitor(model, optimizer=opt, every=10, log=tmp_path / "monitor.jsonl")
    rows = []
    for step in range(steps):
        x = torch.randn(64, 16)  # fresh data every step: batch noise, and no overfitting possible
        # labels drawn from the teacher's distribution: irreducible noise, the loss stays off zero
        y = torch.multinomial(torch.softmax(teacher(x) * 3, dim=1), 1).squeeze(1)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        monitor.after_backward(loss, step)
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 100.0)
        opt.step()
        sched.step()
        row = {"step": step, "loss": loss.item(), "grad_norm": gn.item(), "lr": sched.get_last_lr()[0]}
        if step % 25 == 0 or step == steps - 1:
            with torch.no_grad():
                row["val_loss"] = torch.nn.functional.cross_entropy(model(val_x), val_y).item()
        rows.append(row)
    return rows, monitor.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("seed", [0, 1])
def test_real_tiny_run_is_clean(tmp_path, seed):
    """Logs of a healthy run with warmup and two LR drops: no warning or error, any format."""
    rows, monitor_findings = _train(tmp_path, seed)
    assert rows[-1]["loss"] < rows[0]["loss"] * 0.7  # it did learn
    with open(tmp_path / "run.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    with open(tmp_path / "run.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["step", "loss", "grad_norm", "lr", "val_loss"])
        w.writeheader()
        w.writerows(rows)
    for name in ("run.jsonl", "run.csv", "monitor.jsonl"):
        report = analyze([load_run(tmp_path / name)])
        severe = [f"{p}: {f.issue}" for p, f in report.findings("warning")]
        assert severe == [], (name, severe)
    assert [f.issue for f in monitor_findings if f.severity != "info"] == []
    both = analyze([load_run(tmp_path / "run.jsonl"), load_run(tmp_path / "monitor.jsonl")])
    assert both.probe("compare").findings[0].severity == "info"  # the same run, logged twice


def _regressor_losses(seed: int, bad_step: int | None, steps: int = 256) -> tuple[list[float], list[float]]:
    """The docs' Lightning example as a plain loop (batch 64, MSE, SGD): one batch's loss reaches
    3-6x its running median as plain noise."""
    torch.manual_seed(seed)
    x = torch.randn(4096, 8)
    y = torch.sin(x[:, :1])
    net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    losses, norms = [], []
    for step in range(steps):
        b = slice((step % 64) * 64, (step % 64 + 1) * 64)
        target = y[b] * (20.0 if step == bad_step else 1.0)  # a corrupt batch: labels scaled
        loss = torch.nn.functional.mse_loss(net(x[b]), target)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), 1e9)))
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses, norms


def _analyze_values(loss: list[float], grad: list[float]):
    run = Run(label="run", source="run.jsonl")
    run.series["loss"] = Series("loss", list(range(len(loss))), loss)
    run.series["grad_norm"] = Series("grad_norm", list(range(len(grad))), grad)
    return analyze([run])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_heavy_tailed_batch_losses_are_not_spikes(seed):
    """Healthy twin of the lone-spike rule: batch losses 3-6x their level, as noise, stay quiet."""
    loss, grad = _regressor_losses(seed, None)
    assert [f.issue for _, f in _analyze_values(loss, grad).findings("warning")] == []


@pytest.mark.timeout(120)
def test_corrupt_batch_in_heavy_tailed_losses_is_a_spike():
    """Labels x20 at step 90 of the same run: a spike at step 90."""
    loss, grad = _regressor_losses(0, 90)
    spikes = _analyze_values(loss, grad).probe("spikes")
    assert [e["step"] for e in spikes.details["events"] if e["severity"] == "warning"][:1] == [90]
