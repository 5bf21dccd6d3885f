"""moe_routing on real gloo ranks: router randomness and uneven capacity are named; the twin is silent."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness import run_check

pytestmark = pytest.mark.timeout(120)

TARGETS = Path(__file__).parent / "targets"


def _run(workdir: Path, target: str | None, *extra: str, world: int = 2):
    args = ["--probes", "moe_routing", *extra] + (["--target", str(TARGETS / f"{target}.py")] if target else [])
    result = run_check(world, args, workdir, timeout=90)
    assert not result.timed_out, result.stderr
    return result, result.report().probe("moe_routing")


def _errors(probe) -> list:
    return [f for f in probe.findings if f.severity in ("error", "critical")]


def test_healthy_twin_has_no_finding_above_info(workdir):
    """Deterministic router, one capacity, user all_to_all recorded and agreeing: nothing above info."""
    result, probe = _run(workdir, "moe_healthy")
    assert result.codes == [0, 0], result.stderr
    assert [f.issue for f in probe.findings if f.severity != "info"] == []
    # The user model's dispatch must have been recorded and checked, not silently skipped.
    assert not any("issued no all_to_all_single" in f.issue for f in probe.findings), [f.issue for f in probe.findings]
    assert probe.metrics["builtin_max_err"] < 1e-5


def test_builtin_layer_at_four_ranks_conserves_tokens(workdir):
    """No target, 4 ranks: sent == received pairwise in the dispatch table, EP == dense."""
    result, probe = _run(workdir, None, world=4)
    assert result.codes == [0] * 4, result.stderr
    rows = probe.details["table:moe_dispatch"]
    for i in range(4):
        for j in range(4):
            assert rows[i]["sent"][j] == rows[j]["received"][i]


def test_per_call_randomness_is_named(workdir):
    """Noise drawn on every call: the second call routes tokens differently, on every rank."""
    result, probe = _run(workdir, "moe_call_random")
    assert result.codes == [1, 1]
    (f,) = _errors(probe)
    assert "differently on a second call" in f.issue and f.ranks == [0, 1]


def test_per_rank_randomness_is_named(workdir):
    """A rank-seeded jitter: same tokens, different experts on rank 1 than on rank 0."""
    result, probe = _run(workdir, "moe_rank_random")
    assert result.codes == [1, 1]
    (f,) = _errors(probe)
    assert "different experts on rank 1 than on rank 0" in f.issue and f.ranks == [1]


def test_uneven_capacity_is_named_before_gloo_aborts(workdir):
    """capacity 16 + rank: split sizes 32 vs 34 named pairwise and the capacities listed; no SIGABRT."""
    result, probe = _run(workdir, "moe_uneven_capacity")
    assert result.codes == [1, 1], result.stderr
    issues = {f.issue: f for f in _errors(probe)}
    (split,) = [f for i, f in issues.items() if "split sizes disagree" in i]
    assert "rank 0 sends 32 rows to rank 1, which expects 34" in split.evidence
    (cap,) = [f for i, f in issues.items() if "capacity differs" in i]
    assert "rank 0: 16, rank 1: 17" in cap.evidence


def test_route_with_the_wrong_dtype_is_a_clear_finding(workdir):
    """Float scores instead of indices: one error naming dtype and shape on every rank, no hang."""
    result, probe = _run(workdir, "moe_bad_route")
    assert result.codes == [1, 1]
    (f,) = _errors(probe)
    assert "torch.float32 [64, 4]" in f.issue and f.ranks == [0, 1]


def test_a_router_of_another_width_is_not_checked_rather_than_failed(workdir):
    """route() raising on the made-up 16-wide tokens is a warning with the hidden_dim hint; with hidden_dim 32 it passes."""
    result, probe = _run(workdir, "moe_wide_router")
    assert result.codes == [0, 0], result.stderr
    assert _errors(probe) == []
    (warn,) = [f for f in probe.findings if f.severity == "warning"]
    assert "route was not checked: it raised on the tokens distdiag made up" in warn.issue and "hidden_dim" in warn.fix
    cfg = workdir / "moe.toml"
    cfg.write_text("[probes.moe_routing]\nhidden_dim = 32\n")
    result, probe = _run(workdir, "moe_wide_router", "--config", str(cfg))
    assert result.codes == [0, 0], result.stderr
    assert [f.issue for f in probe.findings if f.severity != "info"] == []
    assert any("load per expert" in f.issue and "made up" in f.evidence for f in probe.findings)


def test_builtin_layer_in_two_expert_parallel_groups_conserves_tokens(workdir):
    """4 ranks, ep_size 2: each group of two exchanges its own tokens over its own all_to_all;
    sent == received pairwise within each group, EP == dense, the twin of the whole-world run."""
    cfg = workdir / "ep.toml"
    cfg.write_text("[probes.moe_routing]\nep_size = 2\n")
    result, probe = _run(workdir, None, "--config", str(cfg), world=4)
    assert result.codes == [0] * 4, result.stderr
    assert [f.issue for f in probe.findings if f.severity != "info"] == []
    rows = probe.details["table:moe_dispatch"]
    assert [r["group"] for r in rows] == ["ranks 0-1", "ranks 0-1", "ranks 2-3", "ranks 2-3"]
    for start in (0, 2):
        for i in range(2):
            for j in range(2):
                assert rows[start + i]["sent"][j] == rows[start + j]["received"][i]
    assert probe.metrics["builtin_max_err"] < 1e-5


def test_an_ep_size_that_does_not_divide_the_world_is_one_clear_line(workdir):
    cfg = workdir / "ep.toml"
    cfg.write_text("[probes.moe_routing]\nep_size = 3\n")
    result = run_check(4, ["--probes", "moe_routing", "--config", str(cfg)], workdir, timeout=90)
    assert not result.timed_out, result.stderr
    assert set(result.codes) == {2}, (result.codes, result.stderr)
    assert "ep_size (3) must divide the world size 4" in result.stderr + result.stdout


@pytest.mark.timeout(180)
def test_builtin_layer_groups_by_default_past_eight_ranks(workdir):
    """12 ranks, no option: two groups of 6 (the largest divisor up to 8), not a power of two;
    nothing above info, pairs within each group, each row's group in the table."""
    result, probe = _run(workdir, None, world=12)
    assert result.codes == [0] * 12, result.stderr
    assert [f.issue for f in probe.findings if f.severity != "info"] == []
    rows = probe.details["table:moe_dispatch"]
    assert [r["group"] for r in rows] == ["ranks 0-5"] * 6 + ["ranks 6-11"] * 6
    for start in (0, 6):
        for i in range(6):
            for j in range(6):
                assert rows[start + i]["sent"][j] == rows[start + j]["received"][i]


def test_router_bias_updated_from_local_load_is_named(workdir):
    """An aux-loss-free balancing bias nudged from each rank's own load: the buffer and the routing
    after the target model's step differ across ranks, both errors."""
    result, probe = _run(workdir, "moe_bias_local_load")
    assert result.codes == [1, 1], result.stderr
    issues = [f.issue for f in _errors(probe)]
    assert any("router buffers differ" in i and "gate.expert_bias" in i for i in issues), issues
    assert any("after the target model's training steps" in i for i in issues), issues
    fixes = " ".join(f.fix for f in _errors(probe))
    assert "all_reduce the counts" in fixes


def test_router_bias_updated_from_global_load_is_quiet(workdir):
    """The twin: the load summed over the ranks before the update: router state and routing agree."""
    result = run_check(2, ["--probes", "moe_routing", "--target", str(TARGETS / "moe_bias_local_load.py")], workdir,
                       timeout=90, env={"DISTDIAG_TWIN": "healthy"})
    assert result.codes == [0, 0], result.stderr
    probe = result.report().probe("moe_routing")
    assert [f.issue for f in probe.findings if f.severity != "info"] == []
