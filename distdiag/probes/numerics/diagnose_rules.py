"""The rules of the parity diagnosis (distdiag/probes/numerics/diagnose.py), most specific first.

Each takes the ParityEvidence and returns a Diagnosis when its pattern is there, else None.
Thresholds: RATIO_HIGH for "exactly 1/k"; the dtype's gradient tolerance (``grad_tol``) for
"a pure factor" (what is left once the factor is taken out is within the tolerance parity
itself uses) and for "the same factor on every rank".
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from distdiag.probes.causes import ProbeCause
from distdiag.probes.numerics.parity_evidence import (
    MICRO_EQUAL,
    RATIO_HIGH,
    Diagnosis,
    ParityEvidence,
    factors_text,
    groups_making,
    locate,
    parts_text,
    rank_factor,
    ratio_to_integer,
)

__all__ = ["RULES", "unexplained"]


def setup(ev: ParityEvidence) -> Diagnosis | None:
    """The weights differ before step 1: setup, not training."""
    if not ev.setup_bad and not ev.ref_differs:
        return None
    lines = []
    if ev.ref_differs:
        shown = "; ".join(f"{n}: ranks {' vs '.join(str(g) for g in groups)}" for n, groups in list(ev.ref_differs.items())[:4])
        lines.append(f"build_model returns different weights on different ranks (same seed): {shown}"
                     + (f" ({len(ev.ref_differs)} tensors)" if len(ev.ref_differs) > 4 else ""))
    if ev.setup_bad:
        worst = sorted(ev.setup_bad.values(), key=lambda b: -b["rel"])[:4]
        lines.append("before step 1 the parallel model differs from the reference built the same way: "
                     + "; ".join(f"{b['name']} rel err {b['rel']:.3g} on ranks {b['ranks']}" for b in worst))
    if not ev.ref_differs:
        lines.append("build_model returns the same weights on every rank (the reference's bits agree), so they changed "
                     "on the parallel path: in parallelize (an init, load, copy or cast it runs), or in a build_model "
                     "that returns other weights on its second call")
    lines.append("every later difference follows from it, so no training mechanism is inferred")
    fix = ("make every rank start from the same weights: load or initialise them on every rank (or on rank 0 and "
           "broadcast, e.g. set_model_state_dict(..., broadcast_from_rank0=True)) before fully_shard, and seed "
           "initialisation the same on every rank; the param_sync probe names each tensor and rank before training")
    if not ev.ref_differs:
        fix = ("what parallelize does to the weights makes them differ from build_model's: initialise, load or cast "
               "them in build_model (for every run) before fully_shard; an init that must run after fully_shard goes "
               "through the whole DTensor parameters, not each rank's local shard (to_local() draws the same numbers, "
               "from one seed, on every rank); the tensors above are where it shows")
    return Diagnosis(
        ProbeCause.SETUP_DIVERGENCE, "the weights already differ before the first step (setup, not training)", lines, fix, 0.9)


def _stage(ev: ParityEvidence, split: dict[str, Any]) -> tuple[str, str, str]:
    """(the hook, the candidate settings, what would decide) for the first step where the reference splits."""
    if split["what"] == "loss" and split["step"] == 1:
        hook = "train_step's forward (or the loss_fn it calls)" if ev.train_step else "loss_fn"
        return (hook, "a loss setting read per rank (label smoothing, ignore index, class weights, a loss scale), or a "
                "forward op seeded or configured per rank (dropout, noise)",
                f"print {hook}'s settings on each rank, or call it on rank 0's and rank 1's process with one batch")
    if split["what"] == "loss":
        return ("build_optimizer (or train_step's optimizer step)", "per-rank optimizer settings (lr, weight decay and "
                "which parameters it applies to, betas, eps: the param groups), a learning-rate schedule stepped per "
                "rank, or a hook that edits the parameters after optimizer.step()",
                "print optimizer.param_groups (without 'params': each group's settings and size) on each rank")
    hook = "train_step, between backward and optimizer.step" if ev.train_step else "loss_fn's backward"
    return (hook, "a clipping threshold (max_norm) read per rank, a gradient scale or accumulation count per rank, or "
            "gradient noise seeded per rank", "print the clipping threshold and the gradient scaling on each rank")


def rank_dependent(ev: ParityEvidence) -> Diagnosis | None:
    """The 1-process reference itself differs across ranks, from weights equal on every rank: a hook reads the rank."""
    split = ev.ref_split
    if not split:
        return None
    step, what = split["step"], split["what"]
    values = sorted(split["values"].items())
    shown = ", ".join(f"rank {r} {v:.8g}" for r, v in values[:6]) + (f", ... ({len(values)} ranks)" if len(values) > 6 else "")
    hook, candidates, decide = _stage(ev, split)
    lines = [f"the 1-process reference (the same hooks, the same global batch, seeded alike on every rank) gives a "
             f"different {what} on different ranks at step {step}: {shown}",
             "its weights were bit-identical on every rank before step 1, so build_model is not it"]
    if what == "loss" and step > 1:
        lines.append(f"at step {step - 1} its loss and the gradients it stepped with still agreed on every rank: the "
                     f"update of step {step - 1} differs, so {hook} computes differently per rank")
    elif what == "grad norm":
        lines.append(f"its loss at step {step} agrees on every rank, the gradients the optimizer steps with do not: "
                     f"{hook} computes differently per rank")
    else:
        lines.append(f"from equal weights and the same batch its loss differs: {hook} computes differently per rank")
    lines += [f"candidates: {candidates}; or a rank that computes wrongly (silent data corruption: the determinism "
              "probe compares the reference's bits across ranks)", f"what would decide: {decide}",
              "the parallel run is compared with each rank's own reference, so its differences follow from this one"]
    return Diagnosis(
        ProbeCause.HOOK_DEPENDS_ON_RANK, f"{hook} computes differently on each rank (it reads the rank or a per-rank setting)",
        lines, f"make {hook} compute the same on every rank: read its settings from one config every rank loads (or "
        "broadcast them from rank 0), not from RANK/LOCAL_RANK, a per-node file or a file only some ranks find; which "
        f"setting is not identified: {decide}", 0.85)


def partition(ev: ParityEvidence) -> Diagnosis | None:
    """The ranks' shards do not add up to the global batch: shard_batch duplicates or drops rows (or tokens)."""
    if not ev.ref_counts or not ev.counts:
        return None
    per = [ev.counts.get(r) or {} for r in range(ev.world)]
    for key, label in (("valid", "valid tokens"), ("rows", "rows")):
        if key not in ev.ref_counts or not all(key in c for c in per):
            continue
        total, want = sum(c[key] for c in per), ev.ref_counts[key]
        if total == want:
            return None  # the shards partition the batch (valid tokens decide before rows)
        if key == "rows" and total == ev.world * want:
            return None  # every rank holds every row: split along another dim (the sequence)
        parts = " + ".join(str(c[key]) for c in per)
        more = total > want
        lines = [f"the ranks' shards hold {parts} = {total} {label}; the global batch (shard_batch(batch, 0, 1), the "
                 f"reference's) holds {want}: {abs(total - want)} {label} {'on two ranks' if more else 'on no rank'}",
                 f"loss {ev.mean_loss:.6g} (mean of ranks) vs reference {ev.ref_loss:.6g}: rel err {ev.loss_rel:.2e}"]
        what = ("duplicates part of the batch across ranks (overlapping slices: an off-by-one end)" if more else
                "drops part of the batch (a floor division that leaves the remainder on no rank)")
        return Diagnosis(
            ProbeCause.SHARDS_DO_NOT_PARTITION_BATCH, f"shard_batch {what}", lines,
            "make shard_batch give every row (and valid token) of the global batch to exactly one rank: slices "
            "[rank * n, (rank + 1) * n) with n = rows // world_size, and a global batch padded to a multiple of the "
            "world size with masked-out rows instead of a remainder left out", 0.9)
    return None


def not_reduced(ev: ParityEvidence) -> Diagnosis | None:
    """Nothing on the parallel model reduces gradients (no FSDP, DDP, DTensor or gradient hook)."""
    if ev.reducer != "none" or not ev.gbad:
        return None
    lines = [f"loss rel err {ev.loss_rel:.1e}; gradients differ from the reference's: {factors_text(ev)}",
             "the model parallelize returned has no FSDP module, no DistributedDataParallel wrapper, no DTensor "
             "parameter and no gradient hook: nothing averages its gradients over the ranks",
             *locate(ev.gbad, ev.order)]
    if ev.train_step:
        lines.append("unless train_step reduces them itself (then its reduction is what differs)")
    return Diagnosis(
        ProbeCause.GRADS_NOT_REDUCED, "gradients are never reduced: the parallel model has no data-parallel wrapper", lines,
        "wrap the model in parallelize (fully_shard per block and on the root, or DistributedDataParallel) on every "
        "run: each rank otherwise steps with the gradient of its own shard only and the replicas drift apart",
        0.6 if ev.train_step else 0.85)


def trainable_changed(ev: ParityEvidence) -> Diagnosis | None:
    """parallelize froze (or unfroze) parameters the reference trains: an observation, not an inference."""
    frozen, thawed = ev.trainable_diff.get("frozen") or [], ev.trainable_diff.get("thawed") or []
    if not frozen and not thawed:
        return None
    lines = []
    if frozen:
        lines.append(f"trainable in the reference (build_model as built), requires_grad False on the parallel model: "
                     f"{', '.join(frozen[:6])}{' ...' if len(frozen) > 6 else ''}")
    if thawed:
        lines.append(f"frozen in the reference, trainable on the parallel model: {', '.join(thawed[:6])}")
    lines += ["parallelize (or something it calls) changed which parameters train, so the parallel run steps a "
              "different set of parameters", *locate(ev.gbad or ev.pbad, ev.order)]
    return Diagnosis(
        ProbeCause.PARALLELIZE_CHANGES_TRAINABLE, "parallelize changes which parameters train", lines,
        "set requires_grad in build_model (for every run), not in parallelize: the parallel run must train the "
        "parameters the single-process run trains", 0.9)


def _ddp_unreduced(ev: ParityEvidence) -> Diagnosis | None:
    """Trainable parameters the DDP wrapper holds no reduction for (made trainable after it was built)."""
    gap = ev.ddp_unreduced or {}
    if not gap.get("count") or not ev.gbad:
        return None
    bad = sorted(ev.gbad, key=lambda n: ev.order.index(n) if n in ev.order else len(ev.order))
    lines = [f"DistributedDataParallel reduces {gap['count']} parameter tensor(s) ({gap['bytes']} bytes) fewer than "
             "require grad now: DDP registers its reduction for the parameters that require grad when it is "
             "constructed, so a parameter made trainable after the wrap keeps each rank's own gradient",
             f"over tolerance: {', '.join(bad[:6])}", *locate(ev.gbad, ev.order)]
    return Diagnosis(
        ProbeCause.UNMANAGED_PARAMS, f"{gap['count']} trainable parameter(s) outside DistributedDataParallel's reduction: their "
        "gradients are not averaged over the ranks", lines,
        f"set requires_grad (unfreeze {', '.join(bad[:3])}) before DistributedDataParallel is built, or build it again "
        "after changing which parameters train: DDP reduces only the parameters that required grad at construction",
        0.9 if len(ev.gbad) <= gap["count"] else 0.7)


def unmanaged(ev: ParityEvidence) -> Diagnosis | None:
    """Plain parameters FSDP does not manage: their gradients are never reduced."""
    if ev.reducer == "ddp":
        return _ddp_unreduced(ev)
    plain = [n for n, b in ev.gbad.items() if b.get("sharded") is False]
    if not plain or not ev.sharded_params:  # all plain: a replicated model (DDP), not parameters FSDP left out
        return None
    if ev.fsdp is False:  # DTensors from a tensor-parallel plan, no FSDP: the plan left them out
        return Diagnosis(
            ProbeCause.UNMANAGED_PARAMS, f"{len(plain)} plain parameter(s) outside the tensor-parallel plan: their gradients "
            "are not reduced over the ranks", [f"plain tensors (not DTensors) and over tolerance: {', '.join(plain[:6])}",
                                              *locate(ev.gbad, ev.order)],
            f"{', '.join(plain[:4])} are plain parameters of a tensor-parallel model: each rank's gradient holds only its "
            "own part (its sequence positions, or its shard of the activations) and is never summed over the ranks. "
            "Put their modules in the plan (SequenceParallel() for a norm between sequence-sharded activations, or "
            "a style that makes them Replicate DTensors), or all-reduce their gradients over the tensor-parallel group",
            0.8)
    return Diagnosis(
        ProbeCause.UNMANAGED_PARAMS, f"{len(plain)} plain parameter(s) outside every FSDP group: their gradients are not reduced",
        [f"not FSDP-managed (plain tensors) and over tolerance: {', '.join(plain[:6])}", *locate(ev.gbad, ev.order)],
        f"{', '.join(plain[:4])} are plain (not FSDP-managed) parameters on the parallel model, so their gradients "
        "are never reduced across ranks: include them in fully_shard (shard the root module, or the block left out), "
        "or reduce them yourself; see the fsdp_plan probe", 0.9)


def accumulation(ev: ParityEvidence) -> Diagnosis | None:
    """The reference's own train_step is not one step on the global batch (seen in one process)."""
    if not ev.accum_bad:
        return None
    if ev.accum_parts and (told := microbatch_diagnosis(ev.accum_parts)) is not None:
        return told
    return Diagnosis(
        ProbeCause.GRAD_ACCUMULATION_MEANS, "gradient accumulation that is not equivalent to one step on the global batch",
        ["in the reference process, train_step's gradients differ from one loss_fn backward on the same batch "
         "by more than a uniform factor (see the accumulation warning)",
         f"candidates: {ACCUM_CANDIDATES}", f"what would decide: {ACCUM_DECIDES}"],
        ACCUM_FIX, 0.6)


ACCUM_CANDIDATES = ("micro-batch means averaged while the micro-batches hold different token counts (the usual one), "
                    "gradient clipping inside the accumulation loop (after each micro-batch instead of once), a "
                    "micro-batch left out or counted twice, an optimizer step per micro-batch")
ACCUM_MEANS_ONLY = ("micro-batch means averaged while the micro-batches hold different token counts, or any "
                    "per-micro-batch normalisation (a loss divided by its own micro-batch's count)")
ACCUM_DECIDES = ("train_step on a batch whose micro-batches hold equal valid-token counts: equal then, the means "
                 "were it; still different, look at what train_step does between the backward calls")
ACCUM_FIX = ("not identified beyond 'train_step is not one step on the global batch'; if it averages micro-batch "
             "means, sum the per-token losses of every micro-batch and divide once by the global token count, instead "
             "of averaging micro-batch means; if it clips, clip once after the last micro-batch's backward")


def _ratio_lines(ratio: float, k: int, inverted: bool, closeness: float, what: str, groups: dict[str, int]) -> tuple[str, str]:
    made = groups_making(k, groups)
    shown = f"1/{k}" if inverted else f"{k}"
    return (f"{what} ratio parallel/reference {ratio:.8g} = {shown} within {closeness:.1e}",
            f"{k} = " + " = ".join(made) if made else f"{k} is none of this run's group sizes ({groups})")


def loss_scaled(ev: ParityEvidence) -> Diagnosis | None:
    """Loss (and gradients) off by exactly 1/k or k: a loss normalised for the wrong group."""
    if ev.loss_rel <= ev.loss_tol or ev.ref_loss == 0:
        return None
    ratio = ev.mean_loss / ev.ref_loss
    found = ratio_to_integer(ratio)
    if found is None or found[1] > max(RATIO_HIGH, ev.loss_tol):
        return None
    k, closeness, inverted = found
    lines = list(_ratio_lines(ratio, k, inverted, closeness, "loss", ev.groups))
    lines.append(factors_text(ev))
    made = groups_making(k, ev.groups)
    world = ev.groups.get("dp", ev.world) * ev.groups.get("sp", 1)
    if inverted:
        fix = (f"each rank's loss is {k}x too small: gradients are averaged over all {world} ranks, so a rank's loss "
               f"must be its token-loss sum / the global count x {world}; it is missing a factor {k}"
               + (f" ({' or '.join(made)}): multiply by it, or divide by the right group's size" if made else ""))
    else:
        fix = (f"each rank's loss is {k}x too large: it is divided by a group {k}x too small, or multiplied by the "
               "group size twice; scale it once, by the number of ranks the gradients are averaged over")
    factors = _uniform(ev)
    follows = factors is not None and all(abs(f / ratio - 1) <= 10 * ev.grad_tol for f in factors.values())
    if not follows:
        lines.append("the gradients are not the reference's x the same ratio: something besides the loss's scale differs")
    confident = closeness <= RATIO_HIGH and bool(made) and follows
    return Diagnosis(ProbeCause.LOSS_SCALED_WRONG_GROUP, f"the loss is scaled for the wrong group (exactly {'1/' if inverted else ''}{k})",
                     lines, fix, 0.95 if confident else 0.7, uniform=True)


def _counts(ev: ParityEvidence) -> tuple[bool | None, str]:
    """(do the ranks' shard counts differ, the counts as text): None when the shards did not show them."""
    counts = [ev.counts.get(r) or {} for r in range(ev.world)]
    keys = [k for k in ("valid", "rows") if all(k in c for c in counts)]
    if not keys:
        return None, ""
    text = "; ".join(f"{'valid tokens' if k == 'valid' else 'rows'} per rank " + ", ".join(str(c[k]) for c in counts)
                     for k in keys)
    return any(len({c[k] for c in counts}) > 1 for k in keys), text


def _forward_differs(ev: ParityEvidence, located: list[str], counts: str) -> Diagnosis:
    """The loss differs on ranks that hold equal counts: a per-rank mean cannot explain it; not identified."""
    mods = ", ".join(ev.cross_sample[:4])
    model, pair = _shard_loss(ev)
    if not mods and model is False:
        return _loss_does_not_split(ev, located, counts, pair)
    lines = [f"loss {ev.mean_loss:.6g} (mean of ranks) vs reference {ev.ref_loss:.6g}: rel err {ev.loss_rel:.2e}, "
             "no integer ratio", *located,
             f"equal counts on every rank ({counts}): a loss normalised per rank would average to the global mean, "
             "so the per-rank normalisation is ruled out as far as the batch shows its counts"]
    lines.append(f"candidates: {mods} in training mode without SyncBatchNorm (statistics of each rank's own rows; "
                 "param_sync then reports its running statistics differing across ranks), or another op that mixes "
                 "samples in the forward or the loss" if mods else
                 "candidates: an op that mixes samples in the forward or the loss (statistics or a softmax over the "
                 "batch, dropout drawn per rank), or a count the batch does not show (labels padded with another "
                 "ignore index)")
    what = (f"rerun with {mods} converted by torch.nn.SyncBatchNorm.convert_sync_batchnorm (or in eval mode): "
            "the loss then matching the reference decides it") if mods else "rerun with the suspected op disabled"
    lines.append(f"what would decide: {what}")
    return Diagnosis(
        ProbeCause.MECHANISM_NOT_IDENTIFIED, "the forward computes differently per rank (mechanism not identified)", lines,
        f"not identified from this evidence; {what}"
        + (". If it is the BatchNorm, use SyncBatchNorm (or statistics reduced over the data-parallel group) where "
           "the ranks' batches must be normalised together" if mods else ""), 0.4)


def _loss_does_not_split(ev: ParityEvidence, located: list[str], counts: str, pair: str) -> Diagnosis:
    """Equal counts, every module exact, and one shard's loss the same on both models: the model is not what
    differs, loss_fn is - its value on the global batch is not the mean of its values on the shards."""
    lines = [f"loss {ev.mean_loss:.6g} (mean of ranks) vs reference {ev.ref_loss:.6g}: rel err {ev.loss_rel:.2e}, "
             "no integer ratio", *located, f"equal counts on every rank ({counts}): a per-rank normalisation would "
             "average to the global mean",
             f"{pair}, and every module computes the reference's output from the same inputs: the model is not what "
             "differs; loss_fn's value on the global batch is not the mean of its values on the shards",
             "candidates: in loss_fn, something over the rows it is given that is not the shard's share of the global "
             "batch's: targets or pairs indexed by the local position (in-batch negatives, contrastive labels "
             "arange(local batch) over gathered columns), a statistic or softmax over the rows, random draws (noise, "
             "masks, timesteps) that repeat on every rank (one seed) where the reference draws once for the whole "
             "batch; or a shard_batch that does not hand out the rows the reference sees",
             "what would decide: with the reference model, compute loss_fn on the global batch and on each shard: "
             "the shards' losses not averaging to the global one is loss_fn's; then print its terms (targets, draws) "
             "for one shard in both runs"]
    return Diagnosis(
        ProbeCause.MECHANISM_NOT_IDENTIFIED,
        "loss_fn does not split over the batch: the same model gives a shard the same loss, yet the shards' losses do "
        "not average to the global batch's (mechanism not identified)", lines,
        "not identified from this evidence; look in loss_fn for what depends on the rows it is given (positions, "
        "in-batch pairs, per-batch statistics, random draws seeded alike on every rank)", 0.4)


def _count_weighted(ev: ParityEvidence) -> tuple[bool | None, str]:
    """Whether a loss divided by each rank's own count explains the ranks' step-1 losses.

    Rank r's loss a * S_r / c_r (S_r its share of the token-loss sum, c_r its count, a the same on every rank:
    1 for a plain mean, the world size when it also multiplies by it) makes sum_r c_r L_r = a * S, and the
    reference's loss is S / C (C = sum_r c_r): sum_r c_r L_r / (C * reference) is then 1 or the world size, for
    the count (valid tokens or rows) the loss divides by. Only at step 1, where the weights are still equal.
    None when it cannot be told (no per-rank losses, no counts, a reference loss of 0).
    """
    if ev.step != 1 or len(ev.rank_losses) != ev.world or abs(ev.ref_loss) < 1e-12:
        return None, ""
    counts = [ev.counts.get(r) or {} for r in range(ev.world)]
    seen = []
    for key, what in (("valid", "valid tokens"), ("rows", "rows")):
        total = sum(c.get(key, 0) for c in counts)
        if not all(key in c for c in counts) or total <= 0:
            continue
        a = sum(c[key] * loss for c, loss in zip(counts, ev.rank_losses, strict=True)) / (total * ev.ref_loss)
        fit = next((k for k in (1, ev.world) if abs(a / k - 1) <= ev.loss_tol), None)
        if fit is not None:
            return True, (f"the ranks' losses weighted by their {what} give the reference's loss"
                          f"{'' if fit == 1 else f' x {fit}'} (sum c_r L_r / (C x reference) = {a:.6g}): what a loss "
                          "divided by each rank's own count gives")
        seen.append(f"weighted by {what} {a:.6g}")
    if not seen:
        return None, ""
    return False, ("the counts do not explain the losses: a loss divided by each rank's own count makes "
                   f"sum c_r L_r / (C x reference) 1 (or the world size, {ev.world}); here {', '.join(seen)}")


def _shard_loss(ev: ParityEvidence) -> tuple[bool | None, str]:
    """From the module-by-module record (every module exact): does loss_fn give one shard another loss on the
    parallel model than on the reference model? None when no such record."""
    for rank, rec in sorted(ev.localised.items()):
        pair = rec.get("loss") or [None, None]
        if rec.get("error") or rec.get("differing") or not rec.get("compared") or None in pair:
            continue
        text = f"rank {rank}'s shard: loss {pair[0]:.6g} on the parallel model, {pair[1]:.6g} on the reference model"
        return abs(pair[0] - pair[1]) > ev.loss_tol * max(abs(pair[1]), 1e-12), text
    return None, ""


def _not_per_rank(ev: ParityEvidence, located: list[str], counts: str, why: str) -> Diagnosis:
    """The ranks hold different counts, but no per-rank count explains their losses: not identified, and what the
    loss of one shard on both models says about where loss_fn differs."""
    lines = [f"loss {ev.mean_loss:.6g} (mean of ranks) vs reference {ev.ref_loss:.6g}: rel err {ev.loss_rel:.2e}, "
             "no integer ratio", *located, f"the ranks hold different counts ({counts}), but {why}: the per-rank "
             "normalisation is ruled out as far as the batch shows its counts"]
    model, pair = _shard_loss(ev)
    reads = ("loss_fn reads the model beyond its forward's output: a term over the parameters (a penalty or a norm: "
             "under FSDP2 a parameter read in loss_fn is a DTensor, and its to_local() is this rank's shard only), "
             "a branch on the model's type or on DTensor, a buffer read directly")
    shard = ("loss_fn computes something over the shard's rows that is not the shard's share of the global batch's "
             "loss: a statistic over the rows (a mean or std: whitened rewards or advantages, in-batch negatives, "
             "a softmax over the batch), or a count the batch does not show")
    if model is True:
        lines += [f"{pair}, while every module computes the reference's output: loss_fn computes differently on the "
                  "parallel model", f"candidates: {reads}"]
    elif model is False:
        lines += [f"{pair}: the same loss for the same shard, so the model is not what differs", f"candidates: {shard}"]
    else:
        lines.append(f"candidates: {shard}; or {reads}")
    what = ("print each term of loss_fn for one shard on the parallel model and on the reference model" if model else
            "compute that statistic or count over the global batch (pass it through shard_batch) and rerun: the "
            "loss then matching the reference decides it")
    lines.append(f"what would decide: {what}")
    return Diagnosis(ProbeCause.MECHANISM_NOT_IDENTIFIED, "the ranks' losses do not average to the global batch's loss, and no "
                     "per-rank count explains it (mechanism not identified)", lines,
                     f"not identified from this evidence; in loss_fn: {what}", 0.4)


def loss_off(ev: ParityEvidence) -> Diagnosis | None:
    """The loss differs from the first step with the same weights, by no clean ratio: its weighting over ranks,
    when the ranks' counts differ (or are not shown); a forward that differs per rank when they are equal."""
    if ev.loss_rel <= ev.loss_tol:
        return None
    located = locate(ev.gbad or ev.pbad, ev.order)
    differ, counts = _counts(ev)
    if differ is False:
        return _forward_differs(ev, located, counts)
    fits, why = _count_weighted(ev)
    if differ and fits is False:
        return _not_per_rank(ev, located, counts, why)
    lines = [f"loss {ev.mean_loss:.6g} (mean of ranks) vs reference {ev.ref_loss:.6g}: rel err {ev.loss_rel:.2e}, "
             "no integer ratio", *located]
    if ev.step == 1:
        lines.append("the weights were equal before step 1, so the loss function weights the ranks' shards differently "
                     "from the global batch")
    if differ:
        lines.append(f"the ranks hold different counts ({counts}): per-rank means do not average to the global mean")
    if fits:
        lines.append(why)
    lines.append("what would decide: the ranks' valid-token (or sample) counts in shard_batch: unequal counts make "
                 "per-rank means differ from the global mean; equal counts point at the forward instead (dropout on, "
                 "batch norm or another cross-sample op)")
    return Diagnosis(
        ProbeCause.LOSS_NORMALISED_PER_RANK, "the ranks' losses do not average to the global batch's loss", lines,
        "the loss is probably normalised per rank (dividing by this rank's token/sample count) while ranks hold "
        "different counts; divide by the global count (pass it through shard_batch) so that FSDP's average over "
        "ranks gives the global mean", 0.6 if ev.step == 1 else 0.45)


def _uniform(ev: ParityEvidence) -> dict[int, float] | None:
    """Each rank's factor, when every rank's gradients are a pure multiple of the reference's (and some are off)."""
    if not ev.gbad:
        return None  # gradients within tolerance: a factor of ~1 says nothing
    out = {}
    for r, sums in ev.rank_sums.items():
        f, resid = rank_factor(sums)
        if not resid <= ev.grad_tol or f == 0:
            return None
        out[r] = f
    return out or None


def clip_per_rank(ev: ParityEvidence) -> Diagnosis | None:
    """Loss exact, each rank's gradients a pure multiple of the reference's, the multiple differing per rank."""
    factors = _uniform(ev)
    if factors is None:
        return None
    spread = (max(factors.values()) - min(factors.values())) / max(abs(f) for f in factors.values())
    if spread <= 10 * ev.grad_tol:
        return None
    lines = [f"loss exact (rel err {ev.loss_rel:.1e})", factors_text(ev),
             f"the factor is constant across the tensors of a rank and differs between ranks (spread {spread:.2g})"]
    return Diagnosis(
        ProbeCause.GRAD_CLIP_PER_RANK, "gradient clipping computed from each rank's local shards", lines,
        "compute the clipping norm over the whole model, not this rank's shards: torch.nn.utils.clip_grad_norm_ on the "
        "DTensor parameters (it reduces the norm across ranks), or all_reduce the sum of squared local norms before "
        "the square root; a per-rank loss scale (one GradScaler per rank) is the other mechanism with this signature",
        0.9 if ev.train_step else 0.75, uniform=True)


def grad_scaled(ev: ParityEvidence) -> Diagnosis | None:
    """Loss exact, every rank's gradients the reference's times the same factor."""
    factors = _uniform(ev)
    if factors is None:
        return None
    f = sum(factors.values()) / len(factors)
    found = ratio_to_integer(f)
    lines = [f"loss exact (rel err {ev.loss_rel:.1e})", factors_text(ev)]
    if (summed := _clip_norms_summed(ev, f, lines)) is not None:
        return summed
    if found is None or found[1] > 10 * ev.grad_tol:
        return Diagnosis(ProbeCause.GRAD_SCALED_UNIFORMLY, f"every gradient is the reference's x {f:.6g} on every rank", lines,
                         "something scales the gradients after backward by a constant the reference does not apply (a "
                         "clipping threshold, a loss-scale left in, a custom reduction); what would decide: the same run "
                         "without train_step's extras", 0.5, uniform=True)
    k, closeness, inverted = found
    lines.append(_ratio_lines(f, k, inverted, closeness, "gradient", {"dp": ev.world})[1])
    if k == ev.world and inverted:
        return Diagnosis(ProbeCause.GRAD_AVERAGED_TWICE, f"gradients averaged twice (exactly 1/{k}, the world size)", lines,
                         f"the gradients are divided by {k} once too often: FSDP2/DDP already average over the {k} "
                         "ranks; remove the extra division (grad /= world_size, a second all_reduce(AVG), a divide "
                         "factor)", 0.9, uniform=True)
    if k == ev.world:
        return Diagnosis(ProbeCause.GRAD_SUMMED_NOT_AVERAGED, f"gradients summed over the {k} ranks, not averaged", lines,
                         f"the reduction sums the {k} ranks' gradients: use ReduceOp.AVG (or divide the sum by {k}); "
                         "with FSDP2 leave the gradient divide factor at its default", 0.9, uniform=True)
    return Diagnosis(ProbeCause.GRAD_SCALE_WRONG_GROUP, f"gradients scaled by {'1/' if inverted else ''}{k}, not a group size here",
                     lines, f"the gradients are reduced or scaled as if the group held {k} ranks: use the group the "
                     "gradients are actually averaged over", 0.6, uniform=True)


def grad_sync(ev: ParityEvidence) -> Diagnosis | None:
    """Loss exact, gradients wrong by no pure factor: the reduction, its sync or the accumulation."""
    if not ev.gbad:
        return None
    lines = [f"loss within tolerance (rel err {ev.loss_rel:.1e}, tolerance {ev.loss_tol:.0e}): the loss's "
             "normalisation is off by no more than that, which a small loss term normalised per rank (an auxiliary "
             "or z-loss) can stay under", factors_text(ev),
             *locate(ev.gbad, ev.order)]
    exact = _exact_modules(ev)
    if exact:
        wrong = sorted({_module(n) for n in ev.gbad})
        lines += [f"only {', '.join(wrong[:6])} differ{'s' if len(wrong) == 1 else ''}; the other {len(exact)} module(s) are "
                  "exact: a reduction that skips or wraps every gradient (a sync at the wrong micro-step, a reduce "
                  "dtype) would touch them all",
                  "candidates: an extra or missing reduction of these tensors (an all_reduce in train_step or a hook "
                  "on top of FSDP/DDP's, a tied or shared weight reduced twice), or these tensors reduced over another "
                  "group", f"what would decide: print each rank's gradient of {ev.gbad and sorted(ev.gbad)[0]} before "
                  "and after its reduction, next to the reference's"]
        return Diagnosis(
            ProbeCause.MECHANISM_NOT_IDENTIFIED, f"the gradients of {', '.join(wrong[:3])} are reduced differently from the "
            "others (mechanism not identified)", lines,
            f"not identified from this evidence; look at what reduces {', '.join(wrong[:3])}'s gradients besides "
            "parallelize (train_step, gradient hooks, a tie)", 0.4)
    if ev.train_step:
        lines.append("train_step accumulates as one step on the global batch in the reference process (no accumulation "
                     "warning), so what differs is the parallel reduction of the accumulated gradients")
        return Diagnosis(
            ProbeCause.GRAD_SYNC_MICRO_STEP, "gradient sync at the wrong micro-step (or no_sync misuse)", lines,
            "let gradients reduce once, after the LAST micro-batch's backward: FSDP2 "
            "model.set_requires_gradient_sync(i == last) before each backward (DDP: no_sync() around every micro-batch "
            "but the last); what would decide between this and a custom reduction: the same step with one micro-batch",
            0.7)
    lines += ["candidates: the reduction parallelize sets up, or a backward that differs while the forward does not: "
              "a cross-rank op in loss_fn or the model that carries no gradient (dist.all_gather of the other ranks' "
              "outputs, a detach before it), which leaves the loss exact and every gradient off",
              "what would decide: which tensors are exact (above); a whole module wrong is a reduction hook that "
              "skips it, every tensor wrong is the reduction itself or a backward that differs"]
    return Diagnosis(
        ProbeCause.GRAD_REDUCTION, "gradients reduced differently from an average over ranks", lines,
        "the gradients of the modules named above do not reach the optimizer as the average over ranks: check the "
        "reduction parallelize sets up (hooks, requires_gradient_sync, reduce dtype) for them, and any collective in "
        "loss_fn or the forward (all_gather without autograd passes no gradient back to the other ranks)", 0.5)


def _module(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else "(root)"


def _exact_modules(ev: ParityEvidence) -> list[str]:
    """Modules (by parameter order) none of whose gradients is over tolerance."""
    wrong = {_module(n) for n in ev.gbad}
    return [m for m in dict.fromkeys(_module(n) for n in ev.order) if m not in wrong]


def optimizer(ev: ParityEvidence) -> Diagnosis | None:
    """Gradients exact, parameters off: the optimizer step (or something after it) differs."""
    if ev.gbad or not ev.pbad:
        return None
    return Diagnosis(
        ProbeCause.OPTIMIZER_STEP_DIFFERS, "the optimizer steps differently from the reference's with the same gradients",
        [f"loss exact (rel err {ev.loss_rel:.1e}) and gradients within tolerance, parameters off",
         *locate(ev.pbad, ev.order)],
        "the parallel optimizer or something after its step differs: same build_optimizer for both (hyperparameters, "
        "param groups by name), no per-rank lr schedule, no hook that edits parameters after optimizer.step()", 0.6)


def unexplained(ev: ParityEvidence) -> Diagnosis:
    return Diagnosis(
        ProbeCause.PARITY_UNEXPLAINED, "no single mechanism fits", locate(ev.gbad or ev.pbad, ev.order),
        "compare the named parameters' modules between the reference and the parallel setup (sharding, hooks, "
        "reduction)", 0.3)


RULES: list[Callable[[ParityEvidence], Diagnosis | None]] = [setup, rank_dependent, trainable_changed, unmanaged, not_reduced, accumulation, partition, loss_scaled, loss_off,
                    clip_per_rank, grad_scaled, grad_sync, optimizer]


def microbatch_diagnosis(parts: dict[str, Any]) -> Diagnosis | None:
    """What the micro-batches' weights in train_step's step say (microbatches.explain), or None."""
    if parts["kind"] == "dropped":
        return _dropped_microbatches(parts)
    if parts["kind"] == "clipped":
        return _clipped_per_microbatch(parts)
    if parts["kind"] == "weighted":
        # a clip only shrinks: a micro-batch weighing more than in one step did not come from it
        heavier = max(parts["weights"]) > 1 + MICRO_EQUAL
        return Diagnosis(
            ProbeCause.GRAD_ACCUMULATION_MEANS, "micro-batches counted with unequal weights in train_step's accumulation",
            ["in the reference process, " + parts_text(parts), "every micro-batch reached the step, so none was left out "
             "or cleared; " + ("one weighs more than in one step on the global batch, which a clip (it only shrinks a "
                               "gradient) cannot do" if heavier else "the weights are not what a clip after each "
                               "micro-batch makes (its clipped running sums would share one norm)"),
             f"candidates: {ACCUM_MEANS_ONLY}", f"what would decide: {ACCUM_DECIDES}"],
            ACCUM_FIX, 0.7)
    return None


def _clipped_per_microbatch(parts: dict[str, Any]) -> Diagnosis:
    k, weights = parts["k"], parts["weights"]
    return Diagnosis(
        ProbeCause.GRAD_CLIP_INSIDE_ACCUMULATION,
        f"train_step clips the gradients after each of its {k} micro-batches, not once before the step: "
        f"every clipped running sum has norm {parts['max_norm']:.4g}",
        ["in the reference process, " + parts_text(parts),
         "a clip after micro-batch j scales everything accumulated so far: the earlier micro-batches are scaled "
         "again by each later clip (weights " + ", ".join(f"{w:.3g}" for w in weights) + ", falling towards the "
         f"first), and each clipped running sum's norm is the same max_norm ({parts['max_norm']:.4g})"],
        "clip once: call clip_grad_norm_ after the last micro-batch's backward, right before optimizer.step()", 0.85)


def _rows_of(parts: dict[str, Any], which: list[int]) -> str:
    """'rows 6-7' / 'rows 3, 7' of the global batch for 1-based slice numbers (microbatches.slice_rows's cut)."""
    k, rows = parts["k"], parts["rows"]
    spans = [(i - 1) * rows // k for i in which], [i * rows // k - 1 for i in which]
    each = [f"{lo}" if lo == hi else f"{lo}-{hi}" for lo, hi in zip(*spans, strict=True)]
    contiguous = all(spans[0][j + 1] == spans[1][j] + 1 for j in range(len(which) - 1))
    text = f"{spans[0][0]}-{spans[1][-1]}" if contiguous and len(which) > 1 else ", ".join(each)
    return f"row{'s' if spans[1][-1] > spans[0][0] else ''} {text}"


def _dropped_microbatches(parts: dict[str, Any]) -> Diagnosis:
    k, reached, rows = parts["k"], parts["reached"], parts["rows"]
    which = (f"the last micro-batch of {k}" if reached == [k] else f"the first micro-batch of {k}" if reached == [1]
             else f"micro-batch{'es' if len(reached) > 1 else ''} {', '.join(map(str, reached))} of {k}")
    return Diagnosis(
        ProbeCause.GRAD_ACCUMULATION_DROPS_MICROBATCHES,
        f"only {_rows_of(parts, reached)} of the global batch's {rows} ({which} equal contiguous ones) reach "
        f"train_step's optimizer step: the other rows' gradients are cleared or overwritten before it",
        ["in the reference process, " + parts_text(parts),
         "a weight of 0 is a micro-batch whose backward ran but whose gradient the optimizer never saw: "
         "optimizer.zero_grad() (or model.zero_grad(), or .grad assigned) inside the accumulation loop"
         + (", or a loop that stops after the first micro-batch" if reached == [1] else "")],
        "call optimizer.zero_grad() once per optimizer step (before the accumulation loop, or right after "
        "optimizer.step()), not inside the loop; check that nothing assigns or resets .grad between the "
        "micro-batches' backward calls", 0.85)


def _clip_norms_summed(ev: ParityEvidence, f: float, lines: list[str]) -> Diagnosis | None:
    """Every rank's gradients the reference's x the same f < 1, and the ranks' local gradient norms
    add up to the reference's whole norm: a clip whose total norm is the sum of the ranks' norms.

    The reference clips to max_norm M: its norm is M. A clip that all-reduces the local norms
    (not their squares) scales every rank by M / sum_r n_r, so the ranks' clipped local norms
    add up to M too, while their root-sum-of-squares is f x M. The identity needs disjoint
    local parts (every parameter sharded), else it does not hold and nothing is claimed."""
    if not 0 < f < 1 - 10 * ev.grad_tol or len(ev.rank_sums) < 2:
        return None
    local = {r: math.sqrt(max(s[2] + s[3], 0.0)) for r, s in sorted(ev.rank_sums.items())}
    whole = math.sqrt(sum(s[1] for s in ev.rank_sums.values()))
    total = sum(local.values())
    if whole <= 0 or abs(total - whole) > 1e-3 * whole:
        return None
    norms = " + ".join(f"{n:.6g}" for n in local.values())
    lines.append(f"the ranks' local gradient norms add up to the reference's clipped norm: {norms} = {total:.6g} vs "
                 f"{whole:.6g} (rel {abs(total - whole) / whole:.1e}); their root-sum-of-squares is "
                 f"{math.sqrt(sum(n * n for n in local.values())):.6g} = {f:.6g} x it")
    return Diagnosis(
        ProbeCause.GRAD_CLIP_NORM_SUMMED,
        f"the clipping norm is the sum of the {len(local)} ranks' local gradient norms, not the norm of the whole gradient",
        lines,
        "reduce the squares: all_reduce the sum of each rank's squared local norm and take the square root (or call "
        "torch.nn.utils.clip_grad_norm_ on the DTensor parameters, which does it)", 0.85, uniform=True)
