"""loss_parity on real gloo ranks against injected bugs, each with its healthy twin.

The targets live in tests/faults/targets/; DISTDIAG_TWIN=healthy runs the same file
without its bug.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness import run_check

pytestmark = pytest.mark.timeout(150)

TARGETS = Path(__file__).resolve().parent / "targets"
ALL = "fsdp_plan,loss_parity,param_sync,determinism"


def _run(workdir, target: str, probes: str, *, healthy: bool = False, world: int = 2):
    env = {"DISTDIAG_TWIN": "healthy"} if healthy else {}
    args = ["--probes", probes, "--target", str(TARGETS / f"{target}.py")]
    return run_check(world, args, workdir, timeout=120, env=env)


def _errors(report, probe: str):
    return [f for f in report.probe(probe).findings if f.severity in ("error", "critical")]


def test_per_rank_loss_normalisation_is_named(workdir):
    """Loss divided by this rank's valid-token count, ranks holding different counts: divergence at step 1."""
    result = _run(workdir, "per_rank_loss", "loss_parity")
    assert result.codes == [1, 1], result.stderr
    probe = result.report().probe("loss_parity")
    (err,) = _errors(result.report(), "loss_parity")
    assert "diverges from the 1-process reference at step 1" in err.issue
    assert "normalised per rank" in err.fix and "global count" in err.fix
    assert err.cause == "loss_normalised_per_rank" and "valid-token (or sample) counts" in err.evidence
    assert "mean of ranks' losses" in err.evidence
    assert probe.metrics["first_divergent_step"] == 1
    rows = probe.details["table:loss parity"]
    assert [r["ok"] for r in rows] == ["no", "no", "no"]


def test_accumulation_of_micro_batch_means_is_named(workdir):
    """train_step averaging micro-batch means (with clipping): the accumulation warning and the divergence."""
    result = _run(workdir, "accum_means", "loss_parity")
    assert result.codes == [1, 1], result.stderr
    findings = result.report().probe("loss_parity").findings
    (warn,) = [f for f in findings if f.severity == "warning"]
    assert "gradient accumulation in train_step is not equivalent" in warn.issue
    (err,) = [f for f in findings if f.severity == "error"]
    assert "at step 1" in err.issue and "averaging micro-batch means" in err.fix
    assert err.cause == "grad_accumulation_means"


def test_block_left_out_of_fully_shard_is_named(workdir):
    """blocks.1 not under fully_shard: its gradients diverge first, and the fix says they are not FSDP-managed."""
    result = _run(workdir, "unsharded_block", "loss_parity")
    assert result.codes == [1, 1], result.stderr
    (err,) = _errors(result.report(), "loss_parity")
    assert "largest error in module blocks.1" in err.issue and err.cause == "unmanaged_params"
    assert "first in model order: blocks.1" in err.evidence
    assert "not FSDP-managed" in err.fix and "blocks.1" in err.fix


@pytest.mark.parametrize("target", ["per_rank_loss", "accum_means", "unsharded_block"])
def test_healthy_twins_pass_every_numerics_probe(workdir, target):
    """The same targets without their bug: all four probes pass with no finding above info."""
    result = _run(workdir, target, ALL, healthy=True)
    assert result.codes == [0, 0], result.stdout + result.stderr
    report = result.report()
    assert report.findings("warning") == [], [f.issue for _, f in report.findings("warning")]
    assert [p.status for p in report.probes] == ["pass"] * 4
    if target == "accum_means":
        infos = [f.issue for f in report.probe("loss_parity").findings]
        assert any("train_step clips gradients" in i for i in infos), infos
