"""The differential-diagnosis corpus (issue 23 items 1 and 6): parity and sequence-parallel bugs.

Each case is a bug target in tests/corpus/diff_targets/ run through the interface a user
with that bug reaches for (`distdiag.check --target FILE --probes loss_parity` or
`sequence_parallel`) on 2 real gloo ranks (4 for the case that shows k named from a larger group). The bug must be named: an error whose `cause` is
the mechanism, with a fix that fits it (and not one the code already applies). Its twin
(DISTDIAG_TWIN=healthy, the same file without the bug) must leave the probe with no finding
above info. docs/diagnosis-corpus.md has the table.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.harness import run_check

pytestmark = pytest.mark.timeout(150)

TARGETS = Path(__file__).resolve().parent / "diff_targets"


@dataclass(frozen=True)
class Case:
    target: str
    probe: str
    cause: str
    fix_has: tuple[str, ...]
    """Words the fix for this mechanism must hold."""
    fix_lacks: tuple[str, ...] = ()
    """Advice the evidence shows the code already follows (or that belongs to another mechanism)."""
    world: int = 2

    @property
    def id(self) -> str:
        return self.target if self.world == 2 else f"{self.target}-w{self.world}"


_LOSS_RIGHT = ("normalised per rank", "global count")  # the loss is exact in these cases

CASES = [
    Case("par_clip_local_shards", "loss_parity", "grad_clip_per_rank", ("clip_grad_norm_", "whole model"), _LOSS_RIGHT),
    Case("par_sync_wrong_microstep", "loss_parity", "grad_sync_micro_step", ("set_requires_gradient_sync", "LAST micro-batch"),
         _LOSS_RIGHT),
    Case("par_grads_averaged_twice", "loss_parity", "grad_averaged_twice", ("divided by 2 once too often",), _LOSS_RIGHT),
    Case("par_grads_summed", "loss_parity", "grad_summed_not_averaged", ("sums the 2 ranks' gradients", "AVG"), _LOSS_RIGHT),
    Case("par_loss_wrong_group", "loss_parity", "loss_scaled_wrong_group", ("2x too small", "missing a factor 2"),
         ("normalised per rank",)),
    Case("par_loss_wrong_group", "loss_parity", "loss_scaled_wrong_group", ("4x too small", "missing a factor 4 (dp 4)"),
         ("normalised per rank",), world=4),
    Case("par_loss_wrong_group", "loss_parity", "loss_scaled_wrong_group", ("3x too small", "missing a factor 3 (dp 3)"),
         ("normalised per rank",), world=3),
    Case("par_loss_per_rank", "loss_parity", "loss_normalised_per_rank", ("normalised per rank", "global count")),
    Case("par_unmanaged_block", "loss_parity", "unmanaged_params", ("not FSDP-managed", "blocks.1"), _LOSS_RIGHT),
    Case("par_frozen_rank0_load", "loss_parity", "setup_divergence", ("same weights", "param_sync"), _LOSS_RIGHT),
    Case("sp_loss_dp_only", "sequence_parallel", "loss_scaled_wrong_group", ("dp x sp", "1/2"), ("per-rank",)),
    Case("sp_mask_batch_dim", "sequence_parallel", "sp_mask_misaligned", ("attention mask", "sequence dim"),
         ("valid targets", "valid-target")),
    Case("sp_keys_assumed_contiguous", "sequence_parallel", "sp_attention_context", ("global position ids", "zigzag"),
         ("valid targets", "valid-target", "attention mask")),
    Case("sp_shift_after_split", "sequence_parallel", "labels_shifted_after_split", ("before the split",)),
    Case("sp_split_drops_token", "sequence_parallel", "split_drops_tokens", ("every position",)),
    Case("sp_loss_per_rank_mean", "sequence_parallel", "loss_normalised_per_rank", ("valid-target count",)),
]


def _run(workdir: Path, case: Case, healthy: bool):
    env = {"DISTDIAG_TWIN": "healthy"} if healthy else {}
    result = run_check(case.world, ["--probes", case.probe, "--target", str(TARGETS / f"{case.target}.py")], workdir,
                       timeout=120, env=env)
    assert not result.timed_out, result.stderr
    return result, result.report().probe(case.probe)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bug_is_named_with_its_mechanism(workdir, case):
    """The bug: an error whose cause is the mechanism, with a fix for it and none the code already applies."""
    result, probe = _run(workdir, case, healthy=False)
    assert result.codes == [1] * case.world, result.stderr
    errors = [f for f in probe.findings if f.severity in ("error", "critical")]
    named = [f for f in errors if f.cause == case.cause]
    assert named, [(f.cause, f.issue) for f in errors]
    finding = named[0]
    for words in case.fix_has:
        assert words in finding.fix, (words, finding.fix)
    for words in case.fix_lacks:
        assert words not in finding.fix, (words, finding.fix)
    # No other error of this probe contradicts it with another mechanism's fix.
    others = {f.cause for f in errors if f.cause and f.cause != case.cause}
    assert not others - {"empty_shard_zero_division"}, others


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_twin_is_quiet(workdir, case):
    """The fixed twin: exit 0 and nothing above info from the probe."""
    result, probe = _run(workdir, case, healthy=True)
    assert result.codes == [0] * case.world, result.stderr
    assert [f.issue for f in probe.findings if f.severity != "info"] == []
