"""fsdp_plan on real gloo ranks: a tie broken by sharding and a bfloat16 reduction of float32
weights (with its healthy twin), and the audit table as `distdiag report show` renders it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import run_check

pytestmark = pytest.mark.timeout(150)

TARGETS = Path(__file__).resolve().parent / "targets"


def _run(workdir, target: str, probes: str, *, healthy: bool = False, world: int = 2):
    env = {"DISTDIAG_TWIN": "healthy"} if healthy else {}
    return run_check(world, ["--probes", probes, "--target", str(TARGETS / f"{target}.py")], workdir, timeout=120, env=env)


def test_broken_tie_and_low_precision_reduction_are_named(workdir):
    """embed/head tied but sharded separately; layers reduce in bfloat16: an error and a warning."""
    result = _run(workdir, "plan_issues", "fsdp_plan")
    assert result.codes == [1, 1], result.stderr
    findings = result.report().probe("fsdp_plan").findings
    (err,) = [f for f in findings if f.severity == "error"]
    assert "tied parameter group(s) are no longer shared after parallelize: embed.weight = head.weight" in err.issue
    assert err.cause == "tie_sharded_apart" and "not to each user separately" in err.fix, err
    (warn,) = [f for f in findings if f.severity == "warning"]
    assert "reduced in a lower precision" in warn.issue and "reduced in bfloat16, stored in float32" in warn.evidence


@pytest.mark.parametrize("healthy", [False, True], ids=["to_empty-unties", "tied-again-after-to_empty"])
def test_a_tie_broken_by_to_empty_before_sharding_is_told_from_one_sharded_apart(workdir, healthy):
    """Both users of the tie in the root's FSDP group, the tie gone after to_empty(): the fix is to
    tie again after it, not to change the fully_shard calls. Its twin ties again and passes."""
    result = _run(workdir, "tie_to_empty", "fsdp_plan", healthy=healthy)
    if healthy:
        assert result.codes == [0, 0], result.stdout + result.stderr
        assert result.report().findings("warning") == []
        return
    assert result.codes == [1, 1], result.stderr
    (err,) = [f for f in result.report().probe("fsdp_plan").findings if f.severity == "error"]
    assert err.cause == "tie_broken_before_sharding" and "to_empty()" in err.fix, err
    assert "same FSDP group" in err.evidence and "apply fully_shard" not in err.fix, err


def test_healthy_plan_passes_and_the_table_renders_in_report_show(workdir, cli_env):
    """The twin (blocks then root, fp32): no finding above info; the table lists every parameter."""
    result = _run(workdir, "plan_issues", "fsdp_plan,loss_parity", healthy=True)
    assert result.codes == [0, 0], result.stdout + result.stderr
    report = result.report()
    assert report.findings("warning") == []
    rows = report.probe("fsdp_plan").details["table:fsdp plan"]
    by_fqn = {r["fqn"]: r for r in rows}
    assert by_fqn["layers.0.qkv.weight"]["group"] == "layers.0"
    assert by_fqn["norm.weight"]["group"] == "(root)" and by_fqn["norm.weight"]["placements"] == "S(0)"
    assert by_fqn["head.weight"]["tied with"] == "embed.weight"
    shown = subprocess.run(
        [sys.executable, "-m", "distdiag", "report", "show", "--full", str(workdir / "distdiag-report.json")],
        env=cli_env, capture_output=True, text=True, timeout=60,
    )
    assert shown.returncode == 0, shown.stderr
    assert "fsdp plan:" in shown.stdout and "layers.1.down.weight" in shown.stdout and "local numel/rank" in shown.stdout


def test_unsharded_block_is_named_in_the_plan(workdir):
    """blocks.1 left out (no root shard): its params require grad and no group manages them."""
    result = _run(workdir, "unsharded_block", "fsdp_plan,param_sync")
    assert result.codes == [1, 1], result.stderr
    report = result.report()
    (err,) = [f for f in report.probe("fsdp_plan").findings if f.severity == "error"]
    assert "6 trainable parameter(s) are not managed by any FSDP group, in module(s) blocks.1:" in err.issue
    assert "blocks.1.up.weight" in err.evidence
    (drift,) = [f for f in report.probe("param_sync").findings if f.severity == "error"]
    assert "unmanaged params blocks.1." in drift.issue and "first after step 1" in drift.issue
