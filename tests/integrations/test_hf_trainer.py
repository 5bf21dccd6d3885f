"""distdiag's callback in a real Hugging Face `Trainer` run (tiny Llama from a config, DDP on gloo,
2 ranks): the healthy twin is quiet and trains to the same losses; a rank sleeping in a callback,
uneven batches per rank and a NaN from one module are each named."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from tests.integrations.common import (  # noqa: E402
    assert_healthy_twin,
    assert_names_short_rank,
    hang_report,
    nan_findings,
    results,
    run_worker,
)

ENTRY = "tests.integrations.hf_worker:main"

pytestmark = [pytest.mark.torchrun, pytest.mark.timeout(200)]


def test_healthy_twin_same_losses_no_finding(tmp_path):
    """Evaluation every 4 steps and a checkpoint at step 6 (both declared phases): exit 0, the same
    losses as the same run without distdiag, nothing above info, no hang report; the monitor's
    log and trainer_state.json are where the Trainer writes."""
    result = run_worker(ENTRY, tmp_path, "twin=1", "evals=4", "save=6")
    assert_healthy_twin(result, tmp_path / "out" / "hang-report")
    out = tmp_path / "out"
    lines = [json.loads(line) for line in (out / "distdiag-metrics.jsonl").read_text().splitlines()]
    logged = {r["step"]: r["loss"] for r in lines if "loss" in r and "kind" not in r}
    state = json.loads((out / "trainer_state.json").read_text())
    trainer = {e["step"] - 1: e["loss"] for e in state["log_history"] if "loss" in e}
    # the monitor saw the loss the Trainer logs (mean over ranks), step by step
    assert logged and all(abs(logged[s] - trainer[s]) < 1e-4 * trainer[s] for s in logged), (logged, trainer)
    assert (out / "checkpoint-6" / "trainer_state.json").exists()
    assert any("eval_loss" in e for e in state["log_history"])


def test_rank_sleeping_in_a_callback_is_named(tmp_path):
    """Rank 1 sleeps in on_step_end at step 4 while rank 0 waits in the Trainer's loss gather."""
    result = run_worker(ENTRY, tmp_path, "fault=sleep", "rank=1", "step=4")
    _, crit = hang_report(result, tmp_path / "out" / "hang-report")
    assert crit[0].ranks == [1] and "FAULT:sleep" in crit[0].issue, crit[0]
    assert result.elapsed < 100, result.elapsed


def test_uneven_batches_per_rank_end_in_a_named_hang(tmp_path):
    """Rank 1's loader holds half the batches: it leaves the loop while rank 0 waits in DDP's
    all-reduce. A report within the deadline, and the job ends (ddp_timeout 60 s > watchdog 8 s)."""
    result = run_worker(ENTRY, tmp_path, "fault=uneven", "rank=1")
    _, crit = hang_report(result, tmp_path / "out" / "hang-report")
    assert result.elapsed < 100, result.elapsed
    assert_names_short_rank(crit, short=1)


def test_nan_from_one_module_names_module_and_step(tmp_path):
    """Rank 1's model.layers.0.mlp outputs NaN from step 4: the loss's first non-finite step and
    the module are named, the update is skipped and the run finishes."""
    per_rank = results(run_worker(ENTRY, tmp_path, "fault=nan", "rank=1", "step=4", "module=model.layers.0.mlp"))
    nan_findings(per_rank, "model.layers.0.mlp", rank=1, step=4)
    issues = [f["issue"] for f in per_rank[0]["findings"]]
    assert "updates whose gradients held NaN/Inf were skipped from step 4" in issues
    state = json.loads((tmp_path / "out" / "trainer_state.json").read_text())
    written = [e["distdiag_finding"]["issue"] for e in state["log_history"] if "distdiag_finding" in e]
    assert any("module 'model.layers.0.mlp'" in i for i in written), written
