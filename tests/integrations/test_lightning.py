"""distdiag's callback in a real Lightning `Trainer` run (a small MLP, DDP on gloo, 2 ranks): the
healthy twin is quiet and trains to the same losses; a rank sleeping in a callback, uneven batches
per rank and a NaN from one module are each named."""

from __future__ import annotations

import pytest

pytest.importorskip("lightning")

from tests.integrations.common import (  # noqa: E402
    assert_healthy_twin,
    assert_names_short_rank,
    hang_report,
    nan_findings,
    results,
    run_worker,
)

ENTRY = "tests.integrations.lightning_worker:main"

pytestmark = [pytest.mark.torchrun, pytest.mark.timeout(200)]


def test_healthy_twin_same_losses_no_finding(tmp_path):
    """Validation twice an epoch (a declared phase): exit 0, the same losses as without distdiag,
    nothing above info, no hang report, the monitor's log beside Lightning's metrics.csv."""
    result = run_worker(ENTRY, tmp_path, "twin=1", "val=1")
    per_rank = assert_healthy_twin(result, tmp_path / "out" / "hang-report")
    log_dir = tmp_path / "out" / "logs" / "version_0"
    assert per_rank[0]["log_dir"] == str(log_dir)
    assert (log_dir / "distdiag-metrics.jsonl").exists() and (log_dir / "metrics.csv").exists()


def test_rank_sleeping_in_a_callback_is_named(tmp_path):
    result = run_worker(ENTRY, tmp_path, "fault=sleep", "rank=1", "step=4")
    _, crit = hang_report(result, tmp_path / "out" / "hang-report")
    assert crit[0].ranks == [1] and "FAULT:sleep" in crit[0].issue, crit[0]
    assert result.elapsed < 100, result.elapsed


def test_uneven_batches_per_rank_end_in_a_named_hang(tmp_path):
    """No DistributedSampler, rank 1 holds half the batches: it finishes while rank 0 waits in
    DDP's all-reduce (DDPStrategy timeout 60 s > watchdog 8 s)."""
    result = run_worker(ENTRY, tmp_path, "fault=uneven", "rank=1")
    _, crit = hang_report(result, tmp_path / "out" / "hang-report")
    assert result.elapsed < 100, result.elapsed
    assert_names_short_rank(crit, short=1)


def test_nan_from_one_module_names_module_and_step(tmp_path):
    per_rank = results(run_worker(ENTRY, tmp_path, "fault=nan", "rank=1", "step=4", "module=net.2"))
    nan_findings(per_rank, "net.2", rank=1, step=4)
