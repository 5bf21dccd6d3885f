"""loss_parity on a tensor + sequence parallel plan (tests/faults/targets/tp_sp_norm.py), real gloo
ranks. The twin's norm runs under SequenceParallel: its weight's gradient is a Partial(sum)
DTensor, whose local part is this rank's share; compared as the full tensor it matches the
reference and the twin is quiet. The bug leaves the norm out of the plan: its plain gradient holds
this rank's positions only and is never summed, and loss_parity names the norm."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness import run_check

pytestmark = pytest.mark.timeout(150)

TARGET = Path(__file__).resolve().parent / "targets" / "tp_sp_norm.py"


def _run(workdir, *, healthy: bool):
    env = {"DISTDIAG_TWIN": "healthy"} if healthy else {}
    result = run_check(2, ["--probes", "loss_parity", "--target", str(TARGET)], workdir, timeout=120, env=env)
    assert not result.timed_out, result.stderr
    return result


def test_partial_sum_gradients_of_a_correct_plan_are_compared_in_full(workdir):
    """The twin: Partial(sum) norm gradients, reduced before the comparison: exit 0, nothing above info."""
    result = _run(workdir, healthy=True)
    report = result.report()
    assert result.codes == [0, 0], [(p, f.issue) for p, f in report.findings("warning")]


def test_norm_left_out_of_the_plan_is_named(workdir):
    """The bug: the norm's gradient is never summed over the ranks: an error locating norm.weight."""
    result = _run(workdir, healthy=False)
    assert result.codes == [1, 1], result.stderr
    (err,) = [f for f in result.report().probe("loss_parity").findings if f.severity == "error"]
    assert "module norm" in err.evidence and "norm.weight" in err.evidence
    assert "exact (every tensor within tolerance): up, down, head" in err.evidence
    assert err.cause == "unmanaged_params" and "SequenceParallel()" in err.fix and "fully_shard" not in err.fix
