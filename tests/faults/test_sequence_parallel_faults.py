"""sequence_parallel on real gloo ranks: each injected SP bug is named; the healthy twin is silent."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness import run_check

pytestmark = pytest.mark.timeout(120)

TARGETS = Path(__file__).parent / "targets"


def _run(workdir: Path, target: str, world: int = 2, healthy: bool = False):
    env = {"DISTDIAG_TWIN": "healthy"} if healthy else {}
    result = run_check(world, ["--probes", "sequence_parallel", "--target", str(TARGETS / f"{target}.py")], workdir,
                       timeout=90, env=env)
    assert not result.timed_out, result.stderr
    return result, result.report().probe("sequence_parallel")


def _errors(probe) -> list:
    return [f for f in probe.findings if f.severity in ("error", "critical")]


@pytest.mark.parametrize("world", [2, 4])
def test_healthy_twin_has_no_finding_above_info(workdir, world):
    """Contiguous split, global positions, valid-token-weighted loss, sequence gather: nothing above info."""
    result, probe = _run(workdir, "sp_healthy", world)
    assert result.codes == [0] * world, result.stderr
    assert [f.issue for f in probe.findings if f.severity != "info"] == []
    assert [m["sp_loss"] for m in probe.metrics["e2e"]] == pytest.approx([m["ref_loss"] for m in probe.metrics["e2e"]], rel=1e-4)


def test_labels_shifted_after_the_split_name_the_boundary_positions(workdir):
    """Shifting per shard loses the target of each shard's last token: rank 0, position 15 (of 32)."""
    result, probe = _run(workdir, "sp_shift_after_split")
    assert result.codes == [1, 1]
    (lost,) = [f for f in _errors(probe) if "shifted after the split" in f.issue]
    assert lost.ranks == [0] and "positions 15 " in lost.evidence


def test_positions_restarting_per_rank_are_named(workdir):
    """Rank 1's position ids 0..15 instead of 16..31: one finding, with the positions."""
    result, probe = _run(workdir, "sp_positions_restart")
    assert result.codes == [1, 1]
    (restart,) = [f for f in _errors(probe) if "restart at 0" in f.issue and "(seq len" not in f.issue]
    assert restart.ranks == [1] and "positions 0..15" in restart.evidence and "global position 16" in restart.evidence


def test_gather_along_the_wrong_dim_is_named(workdir):
    """K/V gathered along dim 0 (batch): the SP output grows by the world size along dim 0."""
    result, probe = _run(workdir, "sp_gather_wrong_dim")
    assert result.codes == [1, 1]
    (shape,) = [f for f in _errors(probe) if "wrong shape" in f.issue]
    assert shape.ranks == [0, 1] and "gathered along dim 0 instead of the sequence dim 1" in shape.evidence


def test_per_rank_mean_loss_is_named_with_valid_counts_and_zero_shard(workdir):
    """Mean over each rank's own tokens: named as such with the counts; the empty shard gives 0/0."""
    result, probe = _run(workdir, "sp_mean_loss")
    assert result.codes == [1, 1]
    issues = [f.issue for f in _errors(probe)]
    assert any("average of per-rank mean losses" in i and "rank 0: 16, rank 1: 7" in i for i in issues), issues
    assert any("not finite" in i and "rank 1 had zero valid targets" in i for i in issues), issues
    # The all-ignored batch is one the probe made: the unsplit mean is nan too, so it is a warning, not an SP error.
    assert not any("all-ignored" in i for i in issues), issues
    (nan_ref,) = [f for f in probe.findings if f.severity == "warning" and "every target is ignored" in f.issue]
    assert "returns nan on the unsplit batch" in nan_ref.issue and "max(valid targets, 1)" in nan_ref.fix


def test_bad_split_output_is_a_finding(workdir):
    """float input_ids of width 3 -> one error naming dtype and shape on every rank; no hang."""
    result, probe = _run(workdir, "sp_bad_split")
    assert result.codes == [1, 1]
    (bad,) = _errors(probe)
    assert "torch.float32 [2, 3]" in bad.evidence and bad.ranks == [0, 1]


def test_a_split_that_refuses_uneven_lengths_is_info_only(workdir):
    """Raising a clear error on seq 33 at world 2 is a handled uneven case: info, exit 0."""
    result, probe = _run(workdir, "sp_even_only")
    assert result.codes == [0, 0], result.stderr
    assert [f.issue for f in probe.findings if f.severity != "info"] == []
    assert any("refuses sequence length 33" in f.issue for f in probe.findings)


@pytest.mark.parametrize("world", [2, 4])
def test_a_split_relying_on_divisible_lengths_warns_only_on_the_made_up_length(workdir, world):
    """Healthy twin: 32-long batches, a floor split; only the probe's length 33 loses a token: one warning, exit 0."""
    result, probe = _run(workdir, "sp_divisible_only", world, healthy=True)
    assert result.codes == [0] * world, result.stderr
    assert _errors(probe) == []
    (warn,) = [f for f in probe.findings if f.severity == "warning"]
    assert "sequence length 33, a length distdiag made up (one more than make_batch(1)'s 32" in warn.issue
    assert f"{world} ranks do not divide it" in warn.issue and "of 33 tokens are on no rank" in warn.issue
    assert "(0, 32)" in warn.evidence and f"dividing by {world}" in warn.fix and "assert" in warn.fix


def test_a_split_losing_tokens_on_the_targets_own_length_is_an_error(workdir):
    """Bug: make_batch's sequences are 33 long and the floor split drops position 32: an error, not 'made up'."""
    result, probe = _run(workdir, "sp_divisible_only")
    assert result.codes == [1, 1]
    (lost,) = _errors(probe)
    assert lost.issue == "split split_sequence: 1 of 33 tokens are on no rank" and "made up" not in lost.issue
    assert "(0, 32)" in lost.evidence and "make_batch(1) has sequences of length 33, which 2 ranks do not divide" in lost.evidence
