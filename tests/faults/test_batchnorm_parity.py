"""BatchNorm under DDP on real gloo ranks (tests/faults/targets/bn_ddp.py). The twin normalises
with the statistics of the whole data-parallel batch (what SyncBatchNorm does): the bias of the
Linear before the norm then has a gradient that is zero up to rounding, and its rounding noise
must not be reported. The bug keeps plain BatchNorm (per-rank statistics) on ranks holding equal
counts: the loss normalisation is not the cause, and the finding must not say it is."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness import run_check

pytestmark = pytest.mark.timeout(150)

TARGET = Path(__file__).resolve().parent / "targets" / "bn_ddp.py"


def _run(workdir, *, healthy: bool):
    env = {"DISTDIAG_TWIN": "healthy"} if healthy else {}
    result = run_check(2, ["--probes", "loss_parity,param_sync", "--target", str(TARGET)], workdir, timeout=120, env=env)
    assert not result.timed_out, result.stderr
    return result


def test_synced_norm_twin_is_quiet_with_a_zero_gradient_bias(workdir):
    """The twin: no finding above info, although proj.bias's gradient is rounding noise on both sides."""
    result = _run(workdir, healthy=True)
    report = result.report()
    assert result.codes == [0, 0], [(p, f.issue) for p, f in report.findings("warning")]
    assert report.findings("warning") == []


def test_batchnorm_without_sync_on_equal_counts_is_not_called_per_rank_normalisation(workdir):
    """The bug: loss_parity says the mechanism is not identified, names the norm and what would decide, and
    gives no loss-normalisation fix; param_sync names the running statistics differing across ranks."""
    result = _run(workdir, healthy=False)
    assert result.codes == [1, 1], result.stderr
    report = result.report()
    (err,) = [f for f in report.probe("loss_parity").findings if f.severity == "error"]
    assert err.cause == "mechanism_not_identified" and err.confidence < 0.5, err
    assert "norm in training mode without SyncBatchNorm" in err.evidence and "rows per rank 12, 12" in err.evidence
    assert "global count" not in err.fix and "normalised per rank" not in err.fix and "convert_sync_batchnorm" in err.fix
    (sync,) = [f for f in report.probe("param_sync").findings if f.severity == "error"]
    assert "norm.running_mean" in sync.issue and "SyncBatchNorm" in sync.fix
