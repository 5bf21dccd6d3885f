"""The numerical probes on user targets with real gloo ranks: the built-in workloads, the
example target, a Hugging Face Llama nobody here wrote, and bad input of every kind."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.harness import run_check

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[2]
TARGETS = ROOT / "tests" / "faults" / "targets"
NUMERICS = "fsdp_plan,loss_parity,param_sync,determinism"


def _clean_pass(result, world: int) -> None:
    assert result.codes == [0] * world, result.stdout + result.stderr
    report = result.report()
    assert report.findings("warning") == [], [f.issue for _, f in report.findings("warning")]
    assert [p.status for p in report.probes] == ["pass"] * len(report.probes)


def test_builtin_workloads_pass_at_four_ranks(workdir):
    """No target: the four probes run on the built-in transformer at 4 ranks and pass."""
    result = run_check(4, ["--probes", NUMERICS], workdir, timeout=150)
    _clean_pass(result, 4)
    assert "built-in workload transformer" in result.report().probe("loss_parity").findings[-1].issue


def test_mlp_workload_by_config_at_two_ranks(workdir):
    """[probes.NAME] workload = "mlp" switches the built-in workload."""
    cfg = workdir / "w.toml"
    cfg.write_text("".join(f'[probes.{p}]\nworkload = "mlp"\n' for p in NUMERICS.split(",")))
    result = run_check(2, ["--probes", NUMERICS, "--config", str(cfg)], workdir, timeout=120)
    _clean_pass(result, 2)
    assert "workload mlp(" in result.report().probe("param_sync").findings[-1].issue


def test_example_target_passes(workdir):
    """configs/example_target.py (AdamW, accumulation, clipping, fp32 reduction) passes all four."""
    result = run_check(2, ["--probes", NUMERICS, "--target", str(ROOT / "configs" / "example_target.py")], workdir, timeout=150)
    _clean_pass(result, 2)


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed (pip install -e '.[test]')")
def test_huggingface_llama_under_fsdp2_per_decoder_layer_passes(workdir):
    """A tiny random LlamaForCausalLM (2 layers, from LlamaConfig, no download), FSDP2 per layer + root."""
    result = run_check(2, ["--probes", NUMERICS, "--target", str(TARGETS / "hf_llama.py")], workdir, timeout=170)
    _clean_pass(result, 2)
    rows = result.report().probe("fsdp_plan").details["table:fsdp plan"]
    assert {r["group"] for r in rows} == {"model.layers.0", "model.layers.1", "(root)"}


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("bad_import", "failed to import: RuntimeError: this target is broken on purpose"),
        ("bad_signature", "hook make_batch must accept (step), but its signature is ()"),
        ("os_exit_at_import", "called os._exit(0) while being imported (at "),
    ],
)
def test_target_that_cannot_load_exits_2_on_every_rank(workdir, target, message):
    """A target that raises or calls os._exit on import, or has a hook with the wrong signature:
    one line, exit 2, every rank."""
    result = run_check(2, ["--probes", "loss_parity", "--target", str(TARGETS / f"{target}.py")], workdir, timeout=60)
    assert result.codes == [2, 2] and not result.timed_out
    for outcome in result.outcomes:
        lines = outcome.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], outcome.stderr


def test_wrong_return_type_and_unsplittable_batch_are_findings(workdir):
    """build_model returning a dict, and 6 samples on 4 ranks: a clear error finding naming the hook, no hang."""
    result = run_check(2, ["--probes", NUMERICS, "--target", str(TARGETS / "bad_return.py")], workdir, timeout=90)
    assert result.codes == [1, 1], result.stderr
    for probe in result.report().probes:
        assert probe.status == "fail"
        assert "hook build_model returned dict, expected a torch.nn.Module" in probe.findings[0].issue
    split = run_check(4, ["--probes", "loss_parity", "--target", str(TARGETS / "bad_split.py")], workdir / "split", timeout=90)
    assert split.codes == [1] * 4, split.stderr
    (err,) = split.report().probe("loss_parity").findings
    assert "6 samples (dim 0), which 4 ranks cannot split evenly" in err.issue


def test_model_too_big_for_the_reference_is_a_finding(workdir):
    """A reference limit below the model size: loss_parity says it does not fit, on every rank, no run."""
    cfg = workdir / "limit.toml"
    cfg.write_text("[probes.loss_parity]\nreference_limit_mib = 0.001\n")
    result = run_check(2, ["--probes", "loss_parity", "--config", str(cfg)], workdir, timeout=90)
    assert result.codes == [1, 1], result.stderr
    (err,) = result.report().probe("loss_parity").findings
    assert "does not fit the reference: the limit is" in err.issue and "reference_limit_mib" in err.issue
    assert err.ranks == [0, 1]


def test_a_pass_says_what_it_checked(workdir):
    """No target: the model probes' rows and the verdict line say they ran on the built-in model (a PASS of
    the stack, not of the user's model); with a target that has no SP or MoE hooks, sequence_parallel and
    moe_routing skip with the reason instead of passing on built-in pieces."""
    from distdiag.report.render import render_report

    result = run_check(2, ["--probes", "env,loss_parity,sequence_parallel,moe_routing"], workdir, timeout=120)
    report = result.report()
    assert result.codes == [0, 0], result.stderr
    assert {p.name for p in report.probes if p.metrics.get("model") == "built-in model"} == {
        "loss_parity", "sequence_parallel", "moe_routing"}
    assert "3 ran on the built-in model: checks the stack, not your model" in report.summary
    rows = {line.split()[0]: line for line in render_report(report).splitlines() if line.startswith(("env", "loss"))}
    assert "built-in model" in rows["loss_parity"] and "built-in model" not in rows["env"]
    target = workdir / "plain_target.py"  # a model, a batch, a loss: no SP or MoE hook
    target.write_text(
        "import torch\n"
        "def build_model():\n    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))\n"
        "def make_batch(step):\n    g = torch.Generator().manual_seed(step)\n"
        "    return {'x': torch.randn(8, 8, generator=g), 'y': torch.randn(8, 4, generator=g)}\n"
        "def loss_fn(model, batch):\n    return torch.nn.functional.mse_loss(model(batch['x']), batch['y'])\n"
    )
    result = run_check(2, ["--probes", "loss_parity,sequence_parallel,moe_routing", "--target", str(target)],
                       workdir, timeout=120)
    report = result.report()
    assert result.codes == [0, 0], result.stderr
    assert report.probe("loss_parity").status == "pass" and "model" not in report.probe("loss_parity").metrics
    for name, hook in (("sequence_parallel", "split_sequence()"), ("moe_routing", "route()")):
        probe = report.probe(name)
        assert probe.status == "skip" and "nothing of yours to check" in probe.reason and hook in probe.reason
    assert "built-in model" not in report.summary
