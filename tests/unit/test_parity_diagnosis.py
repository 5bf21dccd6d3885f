"""The differential diagnosis rules on evidence shaped like loss_parity's and sequence_parallel's (no processes).

The end-to-end proof is tests/corpus/test_differential_corpus.py (real gloo runs); these pin
the thresholds and the order in which rules decide.
"""

from __future__ import annotations

import pytest

from distdiag.probes.numerics.diagnose import ParityEvidence, diagnose_parity, groups_making, ratio_to_integer
from distdiag.probes.sequence_parallel.diagnose import diagnose_loss, diagnose_output


def _ev(**kw) -> ParityEvidence:
    base = dict(step=1, world=2, loss_rel=0.0, loss_tol=1e-4, mean_loss=2.0, ref_loss=2.0, grad_tol=1e-4,
                gbad={"a.w": {"name": "a.w", "rel": 0.5, "ranks": [0, 1], "sharded": True}}, pbad={},
                rank_sums={0: [1.0, 1.0, 0.0, 1.0], 1: [1.0, 1.0, 0.0, 1.0]}, order=["a.w", "b.w"], groups={"dp": 2},
                sharded_params=2)
    base.update(kw)
    return ParityEvidence(**base)


_ALL_BAD = {n: {"name": n, "rel": 0.5, "ranks": [0, 1], "sharded": True} for n in ("a.w", "b.w")}
"""Every module's gradients over tolerance (a reduction that touches them all)."""


def _sums(factor: float, resid: float = 0.0) -> list[float]:
    """scale_fit's terms for g = factor * w plus an orthogonal part of relative size resid (||w|| = 1)."""
    return [factor, 1.0, (resid * factor) ** 2, factor**2]


def test_ratio_to_integer_finds_k_and_its_closeness():
    k, close, inverted = ratio_to_integer(0.5)
    assert (k, inverted) == (2, True) and close == 0.0
    k, close, inverted = ratio_to_integer(4.00002)
    assert (k, inverted) == (4, False) and close == pytest.approx(5e-6)
    assert ratio_to_integer(1.0) is None and ratio_to_integer(float("nan")) is None


def test_groups_making_names_single_groups_and_products():
    assert groups_making(2, {"dp": 1, "sp": 2}) == ["sp 2"]
    assert groups_making(4, {"dp": 2, "sp": 2}) == ["dp 2 x sp 2"]
    assert groups_making(3, {"dp": 2}) == []


def test_per_rank_factors_that_differ_are_clipping_per_rank():
    d = diagnose_parity(_ev(rank_sums={0: _sums(1.44), 1: _sums(1.38)}, train_step=True))
    assert d.cause == "grad_clip_per_rank" and d.confidence == 0.9 and "x1.44" in "\n".join(d.evidence)


def test_the_same_factor_one_over_world_is_grads_averaged_twice():
    assert diagnose_parity(_ev(rank_sums={0: _sums(0.5), 1: _sums(0.5)})).cause == "grad_averaged_twice"
    assert diagnose_parity(_ev(rank_sums={0: _sums(2.0), 1: _sums(2.0)})).cause == "grad_summed_not_averaged"


def test_a_factor_with_a_residual_over_tolerance_is_not_uniform():
    d = diagnose_parity(_ev(rank_sums={0: _sums(0.5, 1e-2), 1: _sums(0.5, 1e-2)}, train_step=True, gbad=_ALL_BAD))
    assert d.cause == "grad_sync_micro_step" and "normalised" not in d.fix


def test_loss_exactly_half_is_a_loss_scaled_for_the_wrong_group():
    d = diagnose_parity(_ev(loss_rel=0.5, mean_loss=1.0, ref_loss=2.0, rank_sums={0: _sums(0.5), 1: _sums(0.5)}))
    assert d.cause == "loss_scaled_wrong_group" and d.confidence == 0.95 and "missing a factor 2 (dp 2)" in d.fix


def test_loss_off_by_no_ratio_is_per_rank_normalisation_with_what_would_decide():
    d = diagnose_parity(_ev(loss_rel=3e-3, mean_loss=2.006, ref_loss=2.0, rank_sums={0: _sums(0.9, 0.3), 1: _sums(1.1, 0.3)}))
    assert d.cause == "loss_normalised_per_rank" and d.confidence < 0.7
    assert any("what would decide" in line for line in d.evidence)


def test_weights_that_differ_before_step_one_win_over_everything_else():
    d = diagnose_parity(_ev(loss_rel=0.5, mean_loss=1.0, ref_loss=2.0, ref_differs={"embed.weight": [[0], [1]]}))
    assert d.cause == "setup_divergence" and "param_sync" in d.fix


def test_weights_changed_on_the_parallel_path_point_at_parallelize_not_at_a_load_on_one_rank():
    """The reference's bits agree across ranks but the parallel model differs before step 1: build_model is not
    rank-dependent, so what differs came after it (parallelize's init, load or cast), and the fix says so."""
    bad = {"head.weight": {"name": "head.weight", "rel": 0.96, "ranks": [0, 1]}}
    d = diagnose_parity(_ev(loss_rel=0.02, mean_loss=3.4, ref_loss=3.5, setup_bad=bad))
    assert d.cause == "setup_divergence" and "parallelize" in d.fix and "broadcast_from_rank0" not in d.fix
    assert any("build_model returns the same weights on every rank" in line for line in d.evidence)


def test_plain_parameters_are_unmanaged_only_when_the_model_is_sharded():
    plain = {"b.w": {"name": "b.w", "rel": 1.0, "ranks": [0, 1], "sharded": False}}
    assert diagnose_parity(_ev(gbad=plain, rank_sums={0: _sums(1, 1), 1: _sums(1, 1)})).cause == "unmanaged_params"
    d = diagnose_parity(_ev(gbad=plain, sharded_params=0, rank_sums={0: _sums(2.0), 1: _sums(2.0)}))
    assert d.cause == "grad_summed_not_averaged"


def test_exact_modules_and_the_largest_error_are_named():
    gbad = {"b.w": {"name": "b.w", "rel": 2.0, "ranks": [0, 1], "sharded": True}}
    d = diagnose_parity(_ev(gbad=gbad, rank_sums={0: _sums(1, 1), 1: _sums(1, 1)}))
    text = "\n".join(d.evidence)
    assert "largest error: module b (b.w, rel err 2)" in text and "exact (every tensor within tolerance): a" in text


def test_sp_loss_exactly_one_over_sp_names_the_group():
    d = diagnose_loss(4.0, {0: 3.0, 1: 1.0}, {0: 30, 1: 14}, None, 1e-4, world=2)
    assert d.cause == "loss_scaled_wrong_group" and "2 = sp 2" in d.evidence and "dp x sp" in d.fix


def test_sp_output_right_without_the_mask_is_the_mask():
    assert diagnose_output({0: "x"}, {0: False, 1: False}).cause == "sp_mask_misaligned"
    assert diagnose_output({0: "x"}, {0: True, 1: False}).confidence == 0.8
    undecided = diagnose_output({0: "x"}, {0: None, 1: None})
    assert undecided.cause == "sp_attention_context" and "what would decide" in undecided.evidence


def test_scale_fit_sums_give_a_pure_factor_across_tensors_and_see_a_mixed_one():
    """Two tensors scaled by 0.5 are one factor (residual ~0); by 0.5 and 0.7 they are not."""
    import torch

    from distdiag.probes.numerics.loss_parity import scale_fit
    from distdiag.probes.numerics.parity_evidence import rank_factor

    a, b = torch.randn(1000, generator=torch.Generator().manual_seed(0)), torch.randn(10)
    same = [x + y for x, y in zip(scale_fit(0.5 * a, a), scale_fit(0.5 * b, b), strict=True)]
    f, resid = rank_factor(same)
    assert f == pytest.approx(0.5) and resid < 1e-6
    mixed = [x + y for x, y in zip(scale_fit(0.5 * a, a), scale_fit(0.7 * b, b), strict=True)]
    assert rank_factor(mixed)[1] > 1e-3


def test_a_half_loss_whose_gradients_do_not_follow_is_said_with_less_confidence():
    d = diagnose_parity(_ev(loss_rel=0.5, mean_loss=1.0, ref_loss=2.0, rank_sums={0: _sums(0.9, 0.3), 1: _sums(1.1, 0.3)}))
    assert d.cause == "loss_scaled_wrong_group" and d.confidence == 0.7
    assert any("not the reference's x the same ratio" in line for line in d.evidence)


def test_every_gradient_off_with_an_exact_loss_lists_a_backward_without_gradient_beside_the_reduction():
    """Loss exact, every module's gradients off by no pure factor, no train_step: the reduction, or a backward that
    differs while the forward does not (a gather in loss_fn that passes no gradient back). Both are candidates."""
    d = diagnose_parity(_ev(rank_sums={0: _sums(0.93, 0.5), 1: _sums(0.89, 1.1)}, gbad=_ALL_BAD))
    assert d.cause == "grad_reduction" and d.confidence == 0.5 and "loss_fn" in d.fix
    assert any("all_gather" in line and "no gradient" in line for line in d.evidence)


def test_the_remaining_parity_rules_on_their_own_patterns():
    """A factor of 1/3 at 2 ranks, a factor that is no 1/k, no train_step, parameters off with exact gradients."""
    assert diagnose_parity(_ev(rank_sums={0: _sums(1 / 3), 1: _sums(1 / 3)})).cause == "grad_scale_wrong_group"
    assert diagnose_parity(_ev(rank_sums={0: _sums(0.8), 1: _sums(0.8)})).cause == "grad_scaled_uniformly"
    assert diagnose_parity(_ev(rank_sums={0: _sums(0.9, 0.3), 1: _sums(1.1, 0.3)}, gbad=_ALL_BAD)).cause == "grad_reduction"
    pbad = {"a.w": {"name": "a.w", "rel": 0.1, "ranks": [0, 1]}}
    assert diagnose_parity(_ev(gbad={}, pbad=pbad)).cause == "optimizer_step_differs"


def test_sp_gradients_off_with_loss_and_output_right_are_the_reduction():
    from distdiag.probes.sequence_parallel.diagnose import diagnose_grads

    d = diagnose_grads({"rel_err": 0.5, "worst": "qkv.weight", "finite": True}, 2)
    assert d.cause == "sp_grad_reduction" and "reduce-scatter" in d.fix
    assert diagnose_grads({"finite": False, "worst": "x"}, 2).cause == "empty_shard_zero_division"


def test_loss_off_on_ranks_with_equal_counts_is_not_per_rank_normalisation():
    """Equal counts on every rank rule the per-rank mean out: mechanism not identified, the BatchNorm named."""
    d = diagnose_parity(_ev(loss_rel=1.6e-2, mean_loss=2.03, ref_loss=2.0, rank_sums={0: _sums(0.9, 0.3), 1: _sums(1.1, 0.3)},
                            counts={0: {"rows": 12}, 1: {"rows": 12}}, cross_sample=["norm"]))
    assert d.cause == "mechanism_not_identified" and d.confidence < 0.5
    assert "global count" not in d.fix and "convert_sync_batchnorm" in d.fix
    text = " ".join(d.evidence)
    assert "rows per rank 12, 12" in text and "norm in training mode without SyncBatchNorm" in text


def test_loss_off_on_ranks_with_different_valid_counts_stays_per_rank_normalisation():
    """Counts that differ keep the per-rank normalisation, with the counts as its evidence."""
    d = diagnose_parity(_ev(loss_rel=3e-3, mean_loss=2.006, ref_loss=2.0, rank_sums={0: _sums(0.9, 0.3), 1: _sums(1.1, 0.3)},
                            counts={0: {"rows": 4, "valid": 10}, 1: {"rows": 4, "valid": 14}}))
    assert d.cause == "loss_normalised_per_rank" and "global count" in d.fix
    assert any("valid tokens per rank 10, 14" in line for line in d.evidence)


def _per_rank(losses: list[float], ref: float, **kw) -> ParityEvidence:
    """Step-1 evidence of a loss off by no ratio, ranks holding 10 and 14 valid tokens (4 rows each)."""
    mean = sum(losses) / len(losses)
    return _ev(loss_rel=abs(mean - ref) / ref, mean_loss=mean, ref_loss=ref, rank_losses=losses,
               rank_sums={0: _sums(0.9, 0.3), 1: _sums(1.1, 0.3)},
               counts={0: {"rows": 4, "valid": 10}, 1: {"rows": 4, "valid": 14}}, **kw)


def test_a_loss_divided_by_each_ranks_own_count_is_confirmed_by_the_count_weighted_losses():
    """Token-loss sums 20 and 42 over 10 and 14 tokens: each rank's own mean (2.0, 3.0), the reference 62/24.
    Weighted by the counts the ranks' losses give the reference's loss back: what a per-rank mean does."""
    d = diagnose_parity(_per_rank([2.0, 3.0], 62 / 24))
    assert d.cause == "loss_normalised_per_rank" and "global count" in d.fix
    assert any("weighted by their valid tokens give the reference's loss" in line for line in d.evidence)


@pytest.mark.parametrize("shard_losses, said", [
    ([4.55, 5.32], "computes differently on the parallel model"),  # loss_fn reads the model beyond its output
    ([4.55, 4.55], "the same loss for the same shard"),  # a statistic over the shard's rows
    (None, "candidates:"),  # no module-by-module record
])
def test_counts_that_do_not_explain_the_losses_rule_the_per_rank_normalisation_out(shard_losses, said):
    """Losses 4.55 and 6.34 on ranks of 10 and 14 tokens, reference 6.18: the count-weighted losses give 0.91 of
    it (not 1, nor the world size), so no per-rank count explains them: not identified, and no global-count fix."""
    rec = {0: {"loss": shard_losses, "compared": 18, "differing": []}} if shard_losses else {}
    d = diagnose_parity(_per_rank([4.55, 6.34], 6.18, localised=rec))
    assert d.cause == "mechanism_not_identified" and d.confidence < 0.5
    assert "global count" not in d.fix and "loss_fn" in d.fix
    text = " ".join(d.evidence)
    assert "per-rank normalisation is ruled out" in text and said in text and "valid tokens per rank 10, 14" in text


def test_per_rank_losses_after_step_1_decide_nothing():
    """After step 1 the weights differ, so the ranks' losses are not those of the reference's weights."""
    d = diagnose_parity(_per_rank([4.55, 6.34], 6.18, step=2))
    assert d.cause == "loss_normalised_per_rank"


def test_shard_counts_read_rows_masks_and_ignored_labels():
    """Rows from dim 0, valid tokens from a mask, else from labels that are not -100."""
    import torch

    from distdiag.probes.numerics.batch_counts import shard_counts

    assert shard_counts({"tokens": torch.zeros(3, 5), "mask": torch.tensor([[1, 1, 0, 0, 0]] * 3)}) == {"rows": 3, "valid": 6}
    assert shard_counts((torch.zeros(4, 2), torch.tensor([1, -100, 2, -100]))) == {"rows": 4, "valid": 2}
    assert shard_counts((torch.zeros(4, 2), torch.tensor([1, 0, 2, 3]))) == {"rows": 4}
    assert shard_counts({"n": 3}) == {}


def test_plain_parameters_of_a_tensor_parallel_model_get_a_plan_fix_not_fully_shard():
    """DTensors from a TP plan and no FSDP module: the plain ones are outside the plan, not outside fully_shard."""
    gbad = {"norm.weight": {"name": "norm.weight", "rel": 1.07, "ranks": [0, 1], "sharded": False}}
    d = diagnose_parity(_ev(gbad=gbad, fsdp=False, rank_sums={0: _sums(1.0, 0.1), 1: _sums(1.0, 0.1)}))
    assert d.cause == "unmanaged_params" and "SequenceParallel()" in d.fix and "fully_shard" not in d.fix
    assert "fully_shard" in diagnose_parity(_ev(gbad=gbad, fsdp=True)).fix


def test_some_modules_exact_is_not_a_micro_step_sync_but_located():
    """Only a.w off, b exact: a sync at the wrong micro-step would touch every module; not identified, located."""
    d = diagnose_parity(_ev(rank_sums={0: _sums(0.9, 0.3), 1: _sums(1.1, 0.3)}, train_step=True))
    assert d.cause == "mechanism_not_identified" and d.confidence < 0.5
    text = "\n".join(d.evidence)
    assert "only a differs" in text and "extra or missing reduction" in text and "what would decide" in text


def test_a_reference_that_differs_across_ranks_is_a_hook_reading_the_rank():
    """The reference's loss differs across ranks at step 1: loss_fn; its stepped grad norm: train_step; its loss
    at step 2 after equal step 1: the optimizer."""
    def split(step, what):
        return {"step": step, "what": what, "values": {0: 1.0, 1: 1.1}, "index": step - 1}

    d = diagnose_parity(_ev(loss_rel=1e-2, mean_loss=2.02, ref_split=split(1, "loss")))
    assert d.cause == "hook_depends_on_rank" and "loss_fn" in d.mechanism and "label smoothing" in "\n".join(d.evidence)
    d = diagnose_parity(_ev(ref_split=split(1, "grad norm"), train_step=True))
    assert "train_step, between backward and optimizer.step" in d.mechanism and "max_norm" in "\n".join(d.evidence)
    d = diagnose_parity(_ev(step=2, ref_split=split(2, "loss")))
    assert "build_optimizer" in d.mechanism and "param_groups" in d.fix
    # weights that differ before step 1 are setup, decided first
    assert diagnose_parity(_ev(ref_split=split(1, "loss"), ref_differs={"a.w": [[0], [1]]})).cause == "setup_divergence"


def test_shards_that_do_not_add_up_to_the_batch():
    """5 + 4 rows of an 8-row batch: duplicated; 4 + 4 of 9: dropped; 8 + 8 of 8 rows: split along another dim."""
    def ev(counts, ref):
        return _ev(loss_rel=1e-2, mean_loss=2.02, counts=counts, ref_counts=ref)

    d = diagnose_parity(ev({0: {"rows": 5}, 1: {"rows": 4}}, {"rows": 8}))
    assert d.cause == "shards_do_not_partition_batch" and "duplicates" in d.mechanism and "5 + 4 = 9 rows" in d.evidence[0]
    d = diagnose_parity(ev({0: {"rows": 4, "valid": 20}, 1: {"rows": 4, "valid": 22}}, {"rows": 9, "valid": 47}))
    assert d.cause == "shards_do_not_partition_batch" and "drops" in d.mechanism and "valid tokens" in d.evidence[0]
    assert diagnose_parity(ev({0: {"rows": 8}, 1: {"rows": 8}}, {"rows": 8})).cause != "shards_do_not_partition_batch"
    # valid tokens that add up decide, whatever the rows say
    assert diagnose_parity(ev({0: {"rows": 8, "valid": 20}, 1: {"rows": 8, "valid": 22}},
                              {"rows": 8, "valid": 42})).cause != "shards_do_not_partition_batch"


def test_a_bare_model_is_gradients_never_reduced():
    d = diagnose_parity(_ev(reducer="none", sharded_params=0, gbad=_ALL_BAD, rank_sums={0: _sums(0.9, 0.3), 1: _sums(1.1, 0.3)}))
    assert d.cause == "grads_not_reduced" and d.confidence == 0.85
    d = diagnose_parity(_ev(reducer="none", sharded_params=0, gbad=_ALL_BAD, train_step=True,
                            rank_sums={0: _sums(0.9, 0.3), 1: _sums(1.1, 0.3)}))
    assert d.cause == "grads_not_reduced" and d.confidence == 0.6  # train_step may reduce them itself
    assert diagnose_parity(_ev(reducer="ddp", sharded_params=0, gbad=_ALL_BAD,
                               rank_sums={0: _sums(0.9, 0.3), 1: _sums(1.1, 0.3)})).cause != "grads_not_reduced"


def test_parameters_frozen_by_parallelize_are_named():
    d = diagnose_parity(_ev(trainable_diff={"frozen": ["embed.weight"], "thawed": []}))
    assert d.cause == "parallelize_changes_trainable" and "embed.weight" in d.evidence[0] and "build_model" in d.fix
    assert diagnose_parity(_ev(trainable_diff={"frozen": [], "thawed": []})).cause != "parallelize_changes_trainable"


def test_a_module_mechanism_confirmed_by_rerun_leads_over_a_rule_that_names_the_place():
    """The rules name the hook that differs per rank (0.85); the module comparison confirms how (0.9): how leads,
    where follows, and the fix speaks of both."""
    from distdiag.probes.numerics.parity_report import _with_localised

    first = {"name": "qkv", "rel": 3e-3, "tol": 1e-4, "shape": {"dtype": ["float32", "bfloat16"]}, "dtype": "float32",
             "ref_dtype": "float32", "children_exact": 0, "extra_calls": None,
             "ref_under_autocast": {"dtype": "bfloat16", "rel": 0.0}}
    rec = {"step": 1, "loss": [1.0, 1.0], "compared": 4, "differing": [first], "first": first, "calls": {}, "state": {},
           "grad_hooks": [], "errors": []}
    split = {"step": 1, "what": "loss", "values": {0: 1.0, 1: 1.1}, "index": 0}
    ev = _ev(loss_rel=1e-2, mean_loss=2.02, ref_split=split, localised={1: rec})
    rules = diagnose_parity(ev)
    assert rules.cause == "hook_depends_on_rank" and rules.confidence >= 0.8
    d = _with_localised(rules, ev)
    assert d.cause == "compute_precision_lower" and d.confidence > rules.confidence
    assert d.mechanism.startswith("qkv computes under torch.autocast(bfloat16) on rank 1") and "loss_fn" in d.mechanism
    assert "autocast" in d.fix.split(";")[0] and "label smoothing" in "\n".join(d.evidence)


def test_a_parameter_made_trainable_after_the_ddp_wrap_is_outside_its_reduction():
    """A real 1-rank DistributedDataParallel built while the embedding was frozen, then the embedding unfrozen:
    its reducer holds one tensor fewer than require grad. The rule names unmanaged_params with a DDP fix; without
    a gap a DDP model's plain parameters stay none of its business."""
    import torch.distributed as dist
    from torch import nn

    from distdiag.probes.numerics.loss_parity import _ddp_unreduced

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = nn.Sequential(nn.Embedding(4, 3), nn.Linear(3, 2))
        model[0].weight.requires_grad_(False)
        wrapped = nn.parallel.DistributedDataParallel(model)
        assert _ddp_unreduced(wrapped) is None  # what requires grad is what DDP reduces
        model[0].weight.requires_grad_(True)
        gap = _ddp_unreduced(wrapped)
    finally:
        dist.destroy_process_group()
    assert gap == {"count": 1, "bytes": 4 * 3 * 4}
    bad = {"embed.weight": {"name": "embed.weight", "rel": 1.0, "ranks": [0, 1], "sharded": False}}
    d = diagnose_parity(_ev(gbad=bad, sharded_params=0, reducer="ddp", ddp_unreduced=gap, order=["embed.weight"],
                            rank_sums={0: _sums(1.0, 0.1), 1: _sums(1.0, 0.1)}))
    assert d.cause == "unmanaged_params" and d.confidence == 0.9 and "before DistributedDataParallel is built" in d.fix
    assert "embed.weight" in d.fix and "fully_shard" not in d.fix
    d = diagnose_parity(_ev(gbad=bad, sharded_params=0, reducer="ddp", order=["embed.weight"],
                            rank_sums={0: _sums(1.0, 0.1), 1: _sums(1.0, 0.1)}))
    assert d.cause != "unmanaged_params"
