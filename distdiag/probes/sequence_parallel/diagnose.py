"""Differential diagnosis of the sequence_parallel end-to-end comparison.

Per batch variant the probe has: the reference loss, each rank's SP loss, each rank's valid
targets and its tokens' loss sum under the reference model, whether the SP output matches
the reference token by token (and, for a padded batch, whether it still differs once the
attention mask is all ones), and the gradients averaged over ranks. These rules turn that
into a mechanism (`cause`), the deciding evidence, a fix for that mechanism only and a
confidence; docs/sequence_moe_checkpoint.md#differential-diagnosis lists them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from distdiag.probes.causes import ProbeCause
from distdiag.probes.numerics.parity_evidence import RATIO_HIGH, groups_making, ratio_to_integer
from distdiag.probes.sequence_parallel.checks import loss_problem

__all__ = ["SpDiagnosis", "diagnose_loss", "diagnose_output", "diagnose_grads"]


@dataclass
class SpDiagnosis:
    kind: str
    issue: str
    evidence: str
    cause: ProbeCause | None
    """None where the evidence names no mechanism."""
    fix: str
    confidence: float
    severity: str = "error"


def _mean(values: dict[int, float]) -> float:
    return sum(values.values()) / len(values)


def _per_rank_means(sp: float, sums: dict[int, float] | None, valid: dict[int, int], rtol: float) -> bool:
    """Whether the SP loss is the average of each rank's own mean token loss."""
    if not sums or not all(valid.get(r, 0) > 0 for r in sums):
        return False
    means = sum(sums[r] / valid[r] for r in sums) / len(sums)
    return abs(means - sp) <= rtol * max(1.0, abs(sp)) * 10


def diagnose_loss(ref: float, sp_values: dict[int, float], valid: dict[int, int], sums: dict[int, float] | None,
                  rtol: float, world: int) -> SpDiagnosis | None:
    """The SP loss against the unsplit one: None when equal (or the reference is not finite)."""
    problem = loss_problem(ref, sp_values, valid, sums, rtol)
    if problem is None:
        return None
    issue, evidence = problem
    sp = _mean(sp_values)
    if not math.isfinite(sp):
        return SpDiagnosis("loss-nan", issue, evidence, ProbeCause.EMPTY_SHARD_ZERO_DIVISION,
                           "a rank (or group) without valid targets divides 0/0: sum the token losses and divide by the "
                           "group's valid-target count with a floor of 1", 0.9)
    found = ratio_to_integer(sp / ref) if ref else None
    groups = {"dp": 1, "sp": world}
    if found is not None and found[1] <= max(RATIO_HIGH, rtol) and groups_making(found[0], groups):
        return _ratio(found, sp, ref, evidence, groups)
    if _per_rank_means(sp, sums, valid, rtol):
        return SpDiagnosis("loss", issue, evidence, ProbeCause.LOSS_NORMALISED_PER_RANK,
                           "weight per-rank losses by valid targets: sum the token losses and divide by the group's "
                           "valid-target count (an all_reduce), with a floor of 1 for empty groups", 0.9)
    return SpDiagnosis("loss", issue, evidence + "\nwhat would decide: the SP output token by token (it matches the "
                       "reference: the loss function; it differs: the model)", None,
                       "compare loss_fn on a shard with the same tokens' share of the unsplit loss", 0.4)


def _ratio(found: tuple[int, float, bool], sp: float, ref: float, evidence: str, groups: dict[str, int]) -> SpDiagnosis:
    k, closeness, inverted = found
    made = " = ".join(groups_making(k, groups))
    world = groups["dp"] * groups["sp"]
    shown = f"1/{k}" if inverted else f"{k}"
    evidence = (f"{evidence}\nratio SP/reference {sp / ref:.8g} = {shown} within {closeness:.1e}; {k} = {made} "
                f"(this run: dp {groups['dp']} x sp {groups['sp']} = {world} ranks)")
    if inverted:
        fix = (f"gradients are averaged over all dp x sp ranks ({world} here), so each rank's loss must be its token-loss "
               f"sum x (dp x sp) / the valid targets of the whole dp x sp group; it comes out 1/{k}, as when it is scaled "
               f"for the data-parallel group alone (x dp, or the targets of dp only): use the dp x sp group's size and "
               "valid-target count")
    else:
        fix = (f"the loss is {k}x too large: it is multiplied by the group size twice or divided by a group {k}x too "
               "small; scale by dp x sp once and divide by the whole group's valid targets")
    return SpDiagnosis("loss", f"the SP loss {sp:.6g} is exactly {shown} of the unsplit batch's {ref:.6g}: scaled for "
                       "the wrong group", evidence, ProbeCause.LOSS_SCALED_WRONG_GROUP, fix, 0.95 if closeness <= RATIO_HIGH else 0.75)


def diagnose_output(mism: dict[int, str], unmasked: dict[int, Any]) -> SpDiagnosis:
    """Output that differs at some positions: the mask's handling, or the attention's context."""
    ranks = sorted(mism)
    evidence = "\n".join(f"rank {r}: {m}" for r, m in sorted(mism.items()))
    issue = f"the SP model's output differs from the reference at some token positions on ranks {ranks}"
    decided = unmasked and all(v is not None for v in unmasked.values())
    if decided and not any(unmasked.values()):
        return SpDiagnosis(
            "output", issue, evidence + "\nwith the attention mask set to all ones, the SP output equals the reference on "
            "every rank: the difference is the mask's handling", ProbeCause.SP_MASK_MISALIGNED,
            "split and gather the attention mask exactly like the keys: along the sequence dim (dim 1 of [batch, seq]) in "
            "rank order; a mask gathered along the batch dim (then reshaped) keeps its shape but moves each sample's "
            "padding onto other samples and positions", 0.9)
    if decided:
        evidence += "\nthe output differs with an all-ones attention mask too: not the mask"
    else:
        evidence += ("\nwhat would decide between the mask and the attention context: the same batch with padding and "
                     "with an all-ones mask (make_batch with padded samples)")
    return SpDiagnosis(
        "output", issue, evidence, ProbeCause.SP_ATTENTION_CONTEXT,
        "the SP model must see the whole causal prefix by global position: gather K/V along the sequence dim in rank "
        "order, and give the keys the global position ids gathered from the shards (not 0..S-1 in gather order: a "
        "zigzag or other non-contiguous split puts them out of order)", 0.8 if decided else 0.6)


def diagnose_grads(grad: dict[str, Any], world: int) -> SpDiagnosis:
    """Loss and output right, gradients off (or not finite)."""
    if not grad.get("finite", True):
        return SpDiagnosis("grad", "SP gradients are not finite", grad.get("worst", ""), ProbeCause.EMPTY_SHARD_ZERO_DIVISION,
                           "a shard or group without valid targets must contribute 0, not 0/0", 0.9)
    return SpDiagnosis(
        "grad", f"SP gradients (averaged over {world} ranks) differ from the unsplit batch's",
        f"worst parameter {grad['worst']}: relative error {grad['rel_err']:.3g}; the loss and the output match the "
        "reference, so the forward and the loss weighting are right", ProbeCause.SP_GRAD_REDUCTION,
        "the backward of the sequence gather must hand each rank its slice of the gradient summed over all ranks "
        "(reduce-scatter), and the parameters' gradients be averaged over the SP group", 0.75)
