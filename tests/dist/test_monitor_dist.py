"""TrainingMonitor on real gloo process groups: the module that produced an injected NaN, the
rank that disagrees, and a quiet healthy twin."""

from __future__ import annotations

import json

import pytest

from tests.harness import run_ranks

ENTRY = "tests.dist.monitor_worker:main"


def _run(tmp_path, scenario: str, world: int = 2):
    result = run_ranks(world, [scenario, str(tmp_path)], tmp_path, entry=ENTRY, timeout=90)
    assert not result.timed_out and result.codes == [0] * world, (result.codes, result.stderr[-3000:])
    per_rank = [json.loads((tmp_path / f"findings{r}.json").read_text()) for r in range(world)]
    return per_rank


def _issues(findings, severity=("warning", "error", "critical")):
    return [(f["issue"], f["ranks"]) for f in findings if f["severity"] in severity]


@pytest.mark.timeout(120)
def test_forward_nan_names_module_and_rank(tmp_path):
    """NaN from rank 1's body.1 forward: the trace names body.1 (Faulty) forward on rank 1, and
    rank 1 is named as the one whose loss disagrees; every rank reaches the same findings."""
    per_rank = _run(tmp_path, "fwd_nan")
    assert per_rank[0] == per_rank[1]
    issues = _issues(per_rank[0])
    trace = [i for i in issues if "first non-finite value" in i[0]]
    assert trace == [("the first non-finite value on rank 1 appeared in its forward: module 'body.1' (Faulty) at step 11", [1])], issues
    assert ("loss became non-finite at step 7 on rank(s) 1", [1]) in issues
    assert any("rank(s) 1 see a non-finite loss" in i and r == [1] for i, r in issues), issues
    # the JSONL log rank 0 wrote carries the same findings for distdiag analyze
    from distdiag.analyze import analyze, load_run

    report = analyze([load_run(tmp_path / "metrics.jsonl")])
    assert report.probe("nonfinite").findings[0].issue == "loss became NaN at step 7"
    assert any("module 'body.1'" in f.issue for f in report.probe("monitor").findings)


@pytest.mark.timeout(120)
def test_backward_nan_names_module(tmp_path):
    """A NaN gradient from rank 0's body.1 backward (forward finite): body.1 backward on rank 0."""
    per_rank = _run(tmp_path, "bwd_nan")
    issues = _issues(per_rank[1])
    trace = [i for i in issues if "first non-finite value" in i[0]]
    assert trace == [("the first non-finite value on rank 0 appeared in its backward: module 'body.1' (Faulty) at step 11", [0])], issues
    assert not any("loss became non-finite" in i for i, _ in issues)


@pytest.mark.timeout(120)
def test_replica_drift_names_the_rank(tmp_path):
    """3 ranks; rank 2's parameters nudged at step 3: rank 2 alone disagrees on the parameter norm."""
    per_rank = _run(tmp_path, "param_drift", world=3)
    issues = _issues(per_rank[0])
    assert any("rank(s) 2 disagree with the others on the replicated parameter norm at step 5" in i and r == [2] for i, r in issues), issues


@pytest.mark.timeout(120)
def test_hand_reduce_twin_is_quiet(tmp_path):
    """param_drift's healthy twin: 3 ranks, no DDP, the same hand all-reduce, nothing nudged:
    no finding above info on any rank (the drift finding comes from the nudge alone)."""
    per_rank = _run(tmp_path, "hand_reduce", world=3)
    assert [_issues(f) for f in per_rank] == [[], [], []]


@pytest.mark.timeout(120)
def test_healthy_twin_is_quiet(tmp_path):
    """The same DDP loop with nothing injected: no finding above info on any rank."""
    per_rank = _run(tmp_path, "healthy")
    assert [_issues(f) for f in per_rank] == [[], []]


def _logged_steps(tmp_path):
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in lines if "loss" in r and r.get("kind") is None]


@pytest.mark.timeout(120)
def test_nan_after_the_last_look_is_found_by_close(tmp_path):
    """24 steps, looks every 5 (the last at 20); rank 1's loss is NaN at step 22: close()'s last
    look (both ranks) names step 22 and rank 1, and the log reaches step 23."""
    per_rank = _run(tmp_path, "late_nan")
    assert per_rank[0] == per_rank[1]
    assert ("loss became non-finite at step 22 on rank(s) 1", [1]) in _issues(per_rank[0]), _issues(per_rank[0])
    assert _logged_steps(tmp_path) == list(range(24))


@pytest.mark.timeout(120)
def test_ranks_reaching_close_apart_skip_the_last_look_together(tmp_path):
    """Rank 1 reaches close() long after rank 0 gave up waiting: neither is left alone in an
    all_reduce (both exit 0); the log ends at the last look, 20."""
    per_rank = _run(tmp_path, "close_apart")
    assert [_issues(f) for f in per_rank] == [[], []]
    assert _logged_steps(tmp_path) == list(range(21))
