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
