"""loss_parity on real gloo ranks against injected bugs, each with its healthy twin.

The targets live in tests/faults/targets/; DISTDIAG_TWIN=healthy runs the same file
without its bug.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness import run_check

pytestmark = pytest.mark.timeout(150)

TARGETS = Path(__file__).resolve().parent / "targets"
GEN_TARGETS = Path(__file__).resolve().parents[1] / "corpus" / "gen_targets"
ALL = "fsdp_plan,loss_parity,param_sync,determinism"


def _run(workdir, target: str, probes: str, *, healthy: bool = False, world: int = 2, env: dict[str, str] | None = None):
    env = {**(env or {}), **({"DISTDIAG_TWIN": "healthy"} if healthy else {})}
    path = TARGETS / f"{target}.py"
    args = ["--probes", probes, "--target", str(path if path.exists() else GEN_TARGETS / f"{target}.py")]
    return run_check(world, args, workdir, timeout=120, env=env)


def _errors(report, probe: str):
    return [f for f in report.probe(probe).findings if f.severity in ("error", "critical")]


def test_per_rank_loss_normalisation_is_named(workdir):
    """Loss divided by this rank's valid-token count, ranks holding different counts: divergence at step 1."""
    result = _run(workdir, "per_rank_loss", "loss_parity")
    assert result.codes == [1, 1], result.stderr
    probe = result.report().probe("loss_parity")
    (err,) = _errors(result.report(), "loss_parity")
    assert "diverges from the 1-process reference at step 1" in err.issue
    assert "normalised per rank" in err.fix and "global count" in err.fix
    assert err.cause == "loss_normalised_per_rank" and "valid-token (or sample) counts" in err.evidence
    assert "mean of ranks' losses" in err.evidence
    assert probe.metrics["first_divergent_step"] == 1
    rows = probe.details["table:loss parity"]
    assert [r["ok"] for r in rows] == ["no", "no", "no"]


def test_accumulation_of_micro_batch_means_is_named(workdir):
    """train_step averaging micro-batch means (with clipping): the accumulation warning and the divergence."""
    result = _run(workdir, "accum_means", "loss_parity")
    assert result.codes == [1, 1], result.stderr
    findings = result.report().probe("loss_parity").findings
    (warn,) = [f for f in findings if f.severity == "warning"]
    assert "gradient accumulation in train_step is not equivalent" in warn.issue
    (err,) = [f for f in findings if f.severity == "error"]
    assert "at step 1" in err.issue and "averaging micro-batch means" in err.fix
    assert err.cause == "grad_accumulation_means"


@pytest.mark.parametrize(("world", "micro"), [(2, 4), (3, 3)])
def test_zero_grad_inside_the_accumulation_loop_names_the_micro_batches_left_out(workdir, world, micro):
    """optimizer.zero_grad() inside the loop: the step holds the last micro-batch's gradient only,
    told by fitting train_step's gradient as a combination of the micro-batches' (weights 0 .. 0, 1)."""
    env = {"DISTDIAG_ACCUM": "zero_grad", "DISTDIAG_MICRO": str(micro)}
    result = _run(workdir, "accum_microbatches", "loss_parity", world=world, env=env)
    assert result.codes == [1] * world, result.stderr
    (err,) = _errors(result.report(), "loss_parity")
    assert err.cause == "grad_accumulation_drops_microbatches" and err.confidence >= 0.8
    rows = 8 if world == 2 else 9  # the built-in transformer's global batch, rounded up to the world
    first = (micro - 1) * rows // micro
    assert f"only rows {first}-{rows - 1} of the global batch's {rows} (the last micro-batch of {micro} " in err.issue
    assert "other rows' gradients are cleared" in err.issue and "zero_grad() once per optimizer step" in err.fix


def test_strided_micro_batches_are_named_by_the_rows_that_reached_the_step(workdir):
    """The same zero_grad bug over strided micro-batches (rows i, i+4, ...): no cut into 2 or 4
    contiguous parts fits, one row per part (8) does: the warning names rows 3 and 7, the last strided
    micro-batch. (The parallel run matches the reference here: each rank's last row is one of them.)"""
    env = {"DISTDIAG_ACCUM": "zero_grad", "DISTDIAG_MICRO": "4", "DISTDIAG_SPLIT": "strided"}
    result = _run(workdir, "accum_microbatches", "loss_parity", env=env)
    assert result.codes == [0, 0], result.stderr
    (warn,) = [f for f in result.report().probe("loss_parity").findings if f.severity == "warning"]
    assert warn.cause == "grad_accumulation_drops_microbatches", (warn.cause, warn.issue)
    assert "only rows 3, 7 of the global batch's 8 (micro-batches 4, 8 of 8 equal contiguous ones)" in warn.issue


@pytest.mark.parametrize(("world", "micro"), [(2, 4), (3, 3)])
def test_a_clip_after_every_micro_batch_is_told_from_averaged_means(workdir, world, micro):
    """clip_grad_norm_ after each micro-batch's backward: every clipped running sum has the max_norm
    (0.2), which the finding gives; not the averaged-means cause."""
    env = {"DISTDIAG_ACCUM": "clip", "DISTDIAG_MICRO": str(micro)}
    result = _run(workdir, "accum_microbatches", "loss_parity", world=world, env=env)
    assert result.codes == [1] * world, result.stderr
    (err,) = _errors(result.report(), "loss_parity")
    assert err.cause == "grad_clip_inside_accumulation", (err.cause, err.issue)
    assert f"after each of its {micro} micro-batches" in err.issue and "norm 0.2" in err.issue
    assert "clip once" in err.fix


@pytest.mark.parametrize("world", [2, 3])
def test_an_accumulation_that_zeroes_and_clips_once_is_quiet(workdir, world):
    """The twin at 2 and 3 ranks: zero_grad before the loop, one clip after it: no finding above info."""
    result = _run(workdir, "accum_microbatches", "loss_parity", world=world, healthy=True,
                  env={"DISTDIAG_MICRO": str(4 if world == 2 else 3)})
    assert result.codes == [0] * world, result.stdout + result.stderr
    assert result.report().findings("warning") == []


@pytest.mark.parametrize("world", [2, 3])
def test_a_clip_norm_summed_over_the_ranks_is_named_by_its_norms(workdir, world):
    """A hand-written clip all-reducing the local norms (not their squares) under FSDP2 (the third
    blind set's target): every rank x the same factor, and the ranks' local norms add up to the
    reference's clipped norm (0.3)."""
    result = _run(workdir, "blind3_clip_sum_of_norms", "loss_parity", world=world)
    assert result.codes == [1] * world, result.stderr
    (err,) = _errors(result.report(), "loss_parity")
    assert err.cause == "grad_clip_norm_summed", (err.cause, err.issue)
    assert f"the sum of the {world} ranks' local gradient norms" in err.issue
    assert "= 0.3 vs 0.3" in err.evidence and "all_reduce the sum of each rank's squared local norm" in err.fix


@pytest.mark.parametrize("world", [2, 3])
def test_a_clip_norm_from_the_summed_squares_is_quiet(workdir, world):
    """The twin: the squares all-reduced, the root taken: no finding above info at 2 and 3 ranks."""
    result = _run(workdir, "blind3_clip_sum_of_norms", "loss_parity", world=world, healthy=True)
    assert result.codes == [0] * world, result.stdout + result.stderr
    assert result.report().findings("warning") == []


@pytest.mark.parametrize("target", ["blind4_clip_value_hook_before_reduce", "blind4_embed_max_norm_lost"])
def test_a_train_step_with_one_backward_is_no_accumulation_warning(workdir, target):
    """Healthy twins whose train_step does one backward and then changes the gradients (a clip by
    value) or whose forward renormalises a weight: no accumulation to check, so no warning (the
    fourth blind set's two warned twins); an info says what differs."""
    result = _run(workdir, target, "loss_parity", healthy=True)
    assert result.codes == [0, 0], result.stdout + result.stderr
    assert result.report().findings("warning") == []
    infos = [f.issue for f in result.report().probe("loss_parity").findings if f.severity == "info"]
    assert any("between its one backward and the optimizer step" in i for i in infos), infos


def test_block_left_out_of_fully_shard_is_named(workdir):
    """blocks.1 not under fully_shard: its gradients diverge first, and the fix says they are not FSDP-managed."""
    result = _run(workdir, "unsharded_block", "loss_parity")
    assert result.codes == [1, 1], result.stderr
    (err,) = _errors(result.report(), "loss_parity")
    assert "largest error in module blocks.1" in err.issue and err.cause == "unmanaged_params"
    assert "first in model order: blocks.1" in err.evidence
    assert "not FSDP-managed" in err.fix and "blocks.1" in err.fix


@pytest.mark.parametrize("target", ["per_rank_loss", "accum_means", "unsharded_block"])
def test_healthy_twins_pass_every_numerics_probe(workdir, target):
    """The same targets without their bug: all four probes pass with no finding above info."""
    result = _run(workdir, target, ALL, healthy=True)
    assert result.codes == [0, 0], result.stdout + result.stderr
    report = result.report()
    assert report.findings("warning") == [], [f.issue for _, f in report.findings("warning")]
    assert [p.status for p in report.probes] == ["pass"] * 4
    if target == "accum_means":
        infos = [f.issue for f in report.probe("loss_parity").findings]
        assert any("train_step clips gradients" in i for i in infos), infos
