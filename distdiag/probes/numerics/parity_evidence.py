"""What the parity diagnosis reads and returns, and the arithmetic its rules share (ratios, factors, modules).

The rules are in distdiag/probes/numerics/diagnose_rules.py; the entry point and what the
diagnosis is for in distdiag/probes/numerics/diagnose.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from distdiag.probes.causes import ProbeCause

__all__ = ["Diagnosis", "ParityEvidence", "ratio_to_integer", "groups_making", "rank_factor", "locate", "factors_text",
           "RATIO_HIGH", "MAX_K"]

RATIO_HIGH = 1e-5
"""A ratio within this of 1/k (or k) is that ratio for certain: float32 rounding of a loss
or a gradient norm over a few thousand terms stays below 1e-6, so 1e-5 leaves 10x margin."""
MAX_K = 4096
"""Largest integer k a ratio is matched against (a group size): beyond, 1/k is rounding."""


@dataclass
class Diagnosis:
    """What a parity failure is, for the finding: the mechanism, why, what to do, how sure."""

    cause: ProbeCause
    mechanism: str
    evidence: list[str]
    fix: str
    confidence: float
    uniform: bool = False
    """Every tensor is off by the same factor (per rank): no module stands out."""


@dataclass
class ParityEvidence:
    """What loss_parity measured at the first divergent step (and before step 1)."""

    step: int
    world: int
    loss_rel: float
    loss_tol: float
    mean_loss: float
    ref_loss: float
    grad_tol: float
    gbad: dict[str, dict[str, Any]]
    pbad: dict[str, dict[str, Any]]
    rank_sums: dict[int, list[float]]
    """Each rank's loss_parity.scale_fit terms summed over all its gradient slices."""
    order: list[str] = field(default_factory=list)
    setup_bad: dict[str, dict[str, Any]] = field(default_factory=dict)
    ref_differs: dict[str, list[list[int]]] = field(default_factory=dict)
    """Reference tensors whose bits differ across ranks: name -> groups of ranks that agree."""
    accum_bad: bool = False
    accum_parts: dict[str, Any] | None = None
    """Which micro-batches (equal contiguous slices) reached train_step's step, by weight (microbatches.explain)."""
    train_step: bool = False
    groups: dict[str, int] = field(default_factory=dict)
    sharded_params: int = 0
    """DTensor parameters on the parallel model: 0 means a replicated (DDP-like) model."""
    fsdp: bool | None = None
    """Whether the parallel model has FSDP modules (False: DTensors from a tensor-parallel plan only);
    None when not recorded."""
    counts: dict[int, dict[str, int]] = field(default_factory=dict)
    """Each rank's shard counts at that step (batch_counts.shard_counts): rows, valid tokens."""
    cross_sample: list[str] = field(default_factory=list)
    """Modules of the parallel model whose forward mixes samples (BatchNorm without SyncBatchNorm)."""
    ref_counts: dict[str, int] = field(default_factory=dict)
    """The reference's counts at that step (the global batch as shard_batch(batch, 0, 1) gives it)."""
    ref_split: dict[str, Any] | None = None
    """The first step at which the 1-process reference itself differs across ranks (same hooks, same global
    batch, same seed): {"step", "what" ("loss" or "grad norm"), "values" {rank: value}, "equal_before"}."""
    trainable_diff: dict[str, list[str]] = field(default_factory=dict)
    """Parameters whose requires_grad parallelize changed: {"frozen": [...], "thawed": [...]} (loss_parity)."""
    reducer: str | None = None
    """What reduces the parallel model's gradients (loss_parity._reducer): fsdp, ddp, dtensor, hooks, none."""
    accum_equal: bool | None = None
    """Whether train_step's gradients equal one loss_fn backward's in the reference process (None: no train_step)."""
    localised: dict[int, dict[str, Any]] = field(default_factory=dict)
    """Each rank's module-by-module record at the first divergent step (loss_parity's localise.py), when it ran."""
    rank_losses: list[float] = field(default_factory=list)
    """Each rank's loss at that step, in rank order (empty when not recorded)."""
    ddp_unreduced: dict[str, int] | None = None
    """Trainable parameters the DistributedDataParallel wrapper does not reduce ({"count", "bytes"}; loss_parity)."""


def ratio_to_integer(ratio: float) -> tuple[int, float, bool] | None:
    """(k, closeness, inverted): ratio ~ 1/k (inverted) or ~ k, for an integer 2 <= k <= MAX_K.

    closeness is |ratio * k - 1| (or |ratio / k - 1|); None when no k is near at all.
    """
    if not math.isfinite(ratio) or ratio <= 0:
        return None
    inverted = ratio < 1
    value = 1 / ratio if inverted else ratio
    k = round(value)
    if not 2 <= k <= MAX_K:
        return None
    return k, abs(value / k - 1), inverted


def groups_making(k: int, groups: dict[str, int]) -> list[str]:
    """The group sizes (and products of them) that equal k, e.g. ['sp 2', 'dp 1 x sp 2']."""
    names = [n for n, s in groups.items() if s > 1]
    out = [f"{n} {groups[n]}" for n in names if groups[n] == k]
    if len(names) > 1 and math.prod(groups[n] for n in names) == k:
        out.append(" x ".join(f"{n} {groups[n]}" for n in names))
    return out


def rank_factor(sums: list[float]) -> tuple[float, float]:
    """(factor, residual) of one rank's gradients against the reference's slices.

    `sums` are loss_parity.scale_fit's terms summed over the rank's tensors: the rank's factor
    is f = sum<g, w> / sum<w, w>, and ||g - f w||^2 over all tensors is each tensor's own
    residual plus (f_t - f)^2 <w, w> of its factor's distance from f, which is
    sum f_t <g, w> - f sum<g, w> (computed in double from float32 terms, without cancellation).
    """
    dot, ww, left, fdot = sums
    if ww <= 0 or not all(math.isfinite(v) for v in sums):
        return 0.0, math.inf
    f = dot / ww
    spread = max(fdot - f * dot, 0.0)
    return f, math.sqrt(left + spread) / max(abs(f) * math.sqrt(ww), 1e-300)


def _module(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else "(root)"


def locate(bad: dict[str, dict[str, Any]], order: list[str]) -> list[str]:
    """The module with the largest error, and the modules whose every tensor is exact."""
    if not bad:
        return []
    worst = max(bad.values(), key=lambda b: b["rel"])
    lines = [f"largest error: module {_module(worst['name'])} ({worst['name']}, rel err {worst['rel']:.3g})"]
    modules = list(dict.fromkeys(_module(n) for n in order))
    wrong = {_module(n) for n in bad}
    exact = [m for m in modules if m not in wrong]
    if exact:
        shown = ", ".join(exact[:8]) + (f", ... ({len(exact)} in all)" if len(exact) > 8 else "")
        lines.append(f"exact (every tensor within tolerance): {shown}; {len(wrong)} of {len(modules)} modules differ")
    elif modules:
        lines.append(f"no module is exact: all {len(modules)} differ")
    return lines


def factors_text(ev: ParityEvidence) -> str:
    """Each rank's gradients as the reference's times a factor, with what is left."""
    parts = []
    for r in sorted(ev.rank_sums):
        f, resid = rank_factor(ev.rank_sums[r])
        parts.append(f"rank {r} x{f:.6g} (residual {resid:.1e})")
    return "gradients = reference x factor per rank: " + ", ".join(parts)


def accumulation_differs(accum: dict[str, Any] | None) -> bool:
    """train_step accumulates over more than one backward, and its gradients are not one loss_fn
    backward's by a uniform factor, from the same state."""
    return bool(accum and not accum["equal"] and accum["scaled_resid"] > 1e-3 and not accum.get("state_changed")
                and not one_backward(accum))


def one_backward(accum: dict[str, Any]) -> bool:
    """train_step ran one backward pass: no accumulation, whatever it did to the gradients after
    (a clip by value, a hook, a forward that changes the weights). Older payloads: unknown."""
    return accum.get("backwards") == 1


def parts_text(parts: dict[str, Any]) -> str:
    """The micro-batches' weights in one sentence: 'of 2 equal contiguous micro-batches of the global
    batch, micro-batch 1 weighs 0 and micro-batch 2 weighs 1 of what one step on it gives them'."""
    weights = ", ".join(f"micro-batch {i + 1} {0.0 if abs(w) < 5e-4 else w:.3g}" for i, w in enumerate(parts["weights"]))
    return (f"cut into {parts['k']} equal contiguous micro-batches, the global batch's gradient is exactly a combination "
            f"of theirs (fit residual {parts['resid']:.1e}); each one's weight in train_step's step relative to one step "
            f"on the global batch: {weights}")


MICRO_EQUAL = 0.02
"""Micro-batch weights within this share of each other (or of 1) are equal; under it of the
largest, a weight is 0 (microbatches.classify and the accumulation rule read it)."""
