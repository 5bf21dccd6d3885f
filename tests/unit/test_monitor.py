"""TrainingMonitor in one process: non-finite origins, checks on components, codes, entropy,
gradients and parameters, config errors. (Cross-rank behaviour: tests/dist/test_monitor_dist.py.)"""

from __future__ import annotations

import json
import math

import pytest
import torch

from distdiag.errors import ConfigError
from distdiag.monitor import MonitorConfig, TrainingMonitor, checks


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class LogZero(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.on = False

    def forward(self, x):
        return torch.log(x.abs() * 0) if self.on else x


def _loop(model, monitor, steps, *, switch=None, loss_fn=None, **kw):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(0)
    for step in range(steps):
        if switch:
            switch(step)
        x = torch.randn(8, 4, generator=gen)
        out = model(x)
        loss = loss_fn(out) if loss_fn else out.pow(2).mean()
        loss.backward()
        monitor.after_backward(loss, step, **kw)
        if torch.isfinite(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e3)):
            opt.step()
        opt.zero_grad()
    return monitor.close()


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), LogZero(), torch.nn.Linear(8, 2))


def test_forward_origin_named_and_hooks_removed(tmp_path):
    """-inf from module '1' (LogZero) from step 6: traced in the step after the look at 8."""
    model = _model()
    mon = TrainingMonitor(model, every=4, log=tmp_path / "m.jsonl")
    findings = _loop(model, mon, 14, switch=lambda s: setattr(model[1], "on", s >= 6))
    issues = [f.issue for f in findings]
    assert "the first non-finite value on rank 0 appeared in its forward: module '1' (LogZero) at step 9" in issues, issues
    assert "loss became non-finite at step 6 on rank(s) 0" in issues
    assert not mon.tracer.armed and all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    kinds = [json.loads(line).get("kind") for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert kinds[0] == "header" and "finding" in kinds


def test_loss_outside_modules_named():
    """A NaN made by the loss function (outside any module): the trace says the loss computation."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    state = {"on": False}
    mon = TrainingMonitor(model, every=2)

    def loss_fn(out):
        return (out.pow(2).mean() * (math.nan if state["on"] else 1.0))

    findings = _loop(model, mon, 8, switch=lambda s: state.update(on=s >= 3), loss_fn=loss_fn)
    trace = [f.issue for f in findings if "first non-finite" in f.issue]
    assert trace == ["the first non-finite value on rank 0 appeared in the loss computed from its output: module '1' (Linear) at step 5"], trace


def test_healthy_loop_with_components_codes_and_logits_is_quiet():
    """Balanced components, well-used codes, a peaked-but-not-collapsed output: nothing above info."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    mon = TrainingMonitor(model, every=5, num_codes=8, entropy_grace_steps=0)
    logits = torch.randn(32, 50)
    findings = _loop(model, mon, 20, components={"a": 1.0, "b": 0.5}, codes=torch.arange(64) % 8, logits=logits)
    assert [f.issue for f in findings if f.severity != "info"] == []
    assert mon.last["codes"]["used_frac"] == 1.0 and mon.last["codes"]["perplexity"] == pytest.approx(8)


def test_update_ratio_logged_and_high_lr_flagged():
    """SGD at lr=10 moves parameters by more than 10% of their norm per step: flagged."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    opt = torch.optim.SGD(model.parameters(), lr=10.0)
    mon = TrainingMonitor(model, optimizer=opt, every=1)
    for step in range(3):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        loss.backward()
        mon.after_backward(loss, step)
        opt.step()
        opt.zero_grad()
    issues = [f.issue for f in mon.close()]
    assert any("one update changed the parameters by" in i and "(above 0.1)" in i for i in issues), issues
    assert mon.last["update_step"] == 1


def test_embedding_heavy_model_warned():
    model = torch.nn.Sequential()
    model.add_module("embed", torch.nn.Embedding(1000, 32))
    model.add_module("head", torch.nn.Linear(32, 4))
    findings = TrainingMonitor(model).close()
    assert any(f.severity == "warning" and "embeddings hold most of the parameters: embed has 32,000" in f.issue for f in findings), findings


def test_checks_components_codes_entropy_grads():
    cfg = MonitorConfig()
    # raw magnitudes 230x apart, the first look: nothing (they are judged each against its own start)
    assert checks.component_checks({"ce": 2.3, "aux": 0.01}, cfg, 0, checks.ComponentHistory()) == []
    hist = checks.ComponentHistory()
    zero = [dict(checks.component_checks({"ce": 2.3, "aux": 0.0}, cfg, s, hist)) for s in (0, 10, 20, 30)]
    assert [("component:zero:aux" in z) for z in zero] == [False, False, False, True]  # step 0 is not counted
    assert "exactly 0 at the 3 looks from step 10 to step 30" in zero[-1]["component:zero:aux"].issue
    stats = {"used_frac": 0.05, "perplexity": 1.5, "top_share": 0.9, "top_code": 3, "tokens": 100}
    keys = dict(checks.code_checks(stats, 64, cfg, 10))
    assert set(keys) == {"codes:collapse", "codes:monopoly"} and "only 3 of the 64 codes" in keys["codes:collapse"].issue
    few = {"used_frac": 8 / 512, "perplexity": 7.0, "top_share": 0.2, "top_code": 3, "tokens": 8}
    assert checks.code_checks(few, 512, cfg, 10) == []  # 8 assignments use 8 codes: all they could
    assert checks.entropy_checks(math.log(100) * 0.95, 100, cfg, 500)[0][0] == "entropy:high"
    assert checks.entropy_checks(math.log(100) * 0.95, 100, cfg, 5) == []  # at initialisation: expected
    assert checks.entropy_checks(0.01, 100, cfg, 500)[0][0] == "entropy:low"
    assert checks.entropy_checks(0.01, 100, cfg, 500, marginal=3.0) == []  # sure of a different token at each position
    grads = dict(checks.grad_checks(5.0, {"embed": 5.0, "head": 0.01, "frozen": 1e-12}, cfg, 7))
    assert "grad:vanish:frozen" in grads and not any(k.startswith("grad:imbalance") for k in grads)
    assert checks.grad_checks(5.0, {"frozen": 1e-12}, cfg, 0, first=True) == []
    kinds = dict(checks.kind_imbalance({"layers.*.w[4]": {"layers.0.w": 0.01, "layers.1.w": 5.0}}, cfg, 7))
    assert "500x layers.0.w" in kinds["grad:imbalance:layers.*.w[4]"].issue
    assert "grad:explode" in dict(checks.grad_checks(5e3, {"a": 5e3}, cfg, 7))


def test_agreement_names_minority_and_says_when_it_cannot():
    cfg = MonitorConfig()
    row = {"step": 5, "loss": 1.0, "grad_bad": False, "grad_plain": 2.0, "param_plain": 3.0, "has_plain": True}
    rows = {0: dict(row), 1: dict(row), 2: dict(row, grad_plain=2.5), 3: dict(row, step=6)}
    found = dict(checks.agreement(rows, cfg, 5))
    assert found["agree:grad_plain"].ranks == [2] and found["agree:step"].ranks == [3]
    two = dict(checks.agreement({0: dict(row), 1: dict(row, param_plain=4.0)}, cfg, 5))
    assert two["agree:param_plain"].ranks == [0, 1] and "no majority" in two["agree:param_plain"].issue
    outlier = dict(checks.agreement({0: dict(row), 1: dict(row), 2: dict(row, loss=50.0)}, cfg, 5))
    assert outlier["agree:loss_outlier:2"].ranks == [2]


def test_config_errors_name_key_value_range():
    with pytest.raises(ConfigError, match=r"monitor.every must be an int >= 1, got 0"):
        TrainingMonitor(torch.nn.Linear(2, 2), every=0)
    with pytest.raises(ConfigError, match=r"monitor.trace must be one of auto, always, off, got 'sometimes'"):
        MonitorConfig(trace="sometimes")


def test_every_keyword_overrides_config_only_when_given():
    model = torch.nn.Linear(2, 2)
    assert TrainingMonitor(model, config=MonitorConfig(every=50)).config.every == 50
    assert TrainingMonitor(model, config=MonitorConfig(every=50), every=7).config.every == 7
    mon = TrainingMonitor(model, config=MonitorConfig(every=50, depth=3), spike_window=5)
    assert (mon.config.every, mon.config.depth, mon.config.spike_window) == (50, 3, 5)
    assert TrainingMonitor(model).config.every == MonitorConfig().every


def test_unknown_keyword_override_is_a_config_error_naming_the_key():
    with pytest.raises(ConfigError, match=r"unknown key monitor\.evry"):
        TrainingMonitor(torch.nn.Linear(2, 2), evry=5)


def test_repeated_finding_keeps_every_field():
    from distdiag.report.model import Finding

    mon = TrainingMonitor(torch.nn.Linear(2, 2))
    f = Finding("warning", "x", "ev", [1], fix="f", confidence=0.5, drain={"host": "h"})
    mon._note("k", f, 3)
    mon._note("k", f, 7)
    (got,) = [g for g in mon.findings if g.issue == "x"]
    assert got.drain == {"host": "h"} and got.ranks == [1] and got.confidence == 0.5
    assert got.evidence == "ev; seen at 2 looks, last at step 7"


def test_leave_one_out_medians_match_the_direct_median():
    from distdiag.analyze.series import median

    for vals in ([1.0, 2.0], [5.0, 1.0, 3.0], [2.0, 2.0, 9.0, 1.0], [4.0, 1.0, 7.0, 3.0, 3.0]):
        d = dict(enumerate(vals))
        got = checks._leave_one_out_medians(d)
        assert got == {r: median([x for q, x in d.items() if q != r]) for r in d}


def _nan_at(step_of_nan, steps, tmp_path, *, every=10, set_to_none=True):
    """A linear model trained `steps` steps, its loss NaN at `step_of_nan` only; (findings, logged steps)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = TrainingMonitor(model, optimizer=opt, every=every, log=tmp_path / "m.jsonl")
    for step in range(steps):
        loss = model(torch.randn(8, 4)).pow(2).mean() * (math.nan if step == step_of_nan else 1.0)
        loss.backward()
        mon.after_backward(loss, step)
        if torch.isfinite(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e3)):
            opt.step()
        opt.zero_grad(set_to_none=set_to_none)
    findings = mon.close()
    lines = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    return findings, [r["step"] for r in lines if "loss" in r and r.get("kind") is None]


def test_close_checks_and_logs_the_steps_after_the_last_look(tmp_path):
    """every=10 over 100 steps, NaN at step 95 (after the last look, at 90): close() finds it; the log reaches step 99."""
    findings, logged = _nan_at(95, 100, tmp_path)
    issues = [f.issue for f in findings]
    assert "loss became non-finite at step 95 on rank(s) 0" in issues, issues
    assert logged == list(range(100)), logged


def test_close_on_a_healthy_run_adds_no_finding(tmp_path):
    """The twin: no NaN, gradients zeroed in place after the last step: close() logs steps 91..99 and finds nothing
    (the zeroed gradients it sees then are not judged as vanishing)."""
    findings, logged = _nan_at(-1, 100, tmp_path, set_to_none=False)
    assert [f.issue for f in findings if f.severity != "info"] == []
    assert logged == list(range(100)), logged
