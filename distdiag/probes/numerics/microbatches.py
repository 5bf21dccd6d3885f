"""Which micro-batches reached train_step's optimizer step, and with what weight.

When train_step's gradients are not one loss_fn backward on the global batch by a uniform factor
(the accumulation check), they may still be an exact combination of the gradients of the batch's
contiguous row slices: the micro-batches train_step most often cuts. This module computes
loss_fn's gradient on each of k equal slices (k = 2, 3, 4, 8), from the state train_step started
from, and fits both gradients (train_step's and one loss_fn backward's) as combinations of them.
Each slice's weight in train_step's step over its weight in one step tells the mechanisms apart:
a weight of 0 is a micro-batch whose gradient never reached the step (cleared or overwritten
between the backward calls); unequal positive weights are micro-batches counted unequally
(micro-batch means averaged, a clip after each micro-batch). No fit, no claim: micro-batches cut
another way, random draws in the loss, or an extra step leave the residual large.

Runs in the reference process only (a plain module, no collective), on step 1, only when the
accumulation check found a difference; it restores the model's parameters, gradients and buffers.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from distdiag.probes import training as tr
from distdiag.probes.numerics.parity_evidence import MICRO_EQUAL
from distdiag.probes.numerics.shared import STEP_SEED

if TYPE_CHECKING:
    from distdiag.runtime.context import RankContext

SPLITS = (2, 3, 4, 8)
FIT_TOLERANCE = 1e-4
"""Relative residual under which a gradient is an exact combination of the slices' (fp32 sums: ~1e-6)."""
_CAP = 1 << 26
"""Parameter elements above which the k slice gradients are not held (k copies of the model's gradients)."""


def _rows(batch: Any) -> int | None:
    """The batch's row count: the leading size of its first tensor with a dimension."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else None
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    for v in items:
        if (rows := _rows(v)) is not None:
            return rows
    return None


def slice_rows(batch: Any, lo: int, hi: int, rows: int) -> Any:
    """Rows lo:hi of every tensor of the batch whose leading size is `rows`; the rest as it is
    (a global token count, a world size: what a micro-batch keeps from its step)."""
    if isinstance(batch, torch.Tensor):
        return batch[lo:hi] if batch.dim() and batch.shape[0] == rows else batch
    if isinstance(batch, dict):
        return {k: slice_rows(v, lo, hi, rows) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(slice_rows(v, lo, hi, rows) for v in batch)
    return batch


def _slice_grads(ctx: RankContext, hooks: tr.Hooks, model: torch.nn.Module, batch: Any, k: int,
                 rows: int) -> list[dict[str, torch.Tensor]]:
    out = []
    for i in range(k):
        model.zero_grad(set_to_none=True)
        ctx.seed(STEP_SEED + 1)  # the draws the accumulation check's own backward had
        tr.call_loss(hooks, model, slice_rows(batch, i * rows // k, (i + 1) * rows // k, rows)).backward()
        out.append({tr.canonical_name(n): p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
    return out


def _dot(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return sum(float(torch.vdot(a[n].double().reshape(-1), b[n].double().reshape(-1))) for n in a if n in b)


def gram(parts: list[dict[str, torch.Tensor]]) -> list[list[float]]:
    """The slices' gradients' dot products."""
    return [[_dot(parts[i], parts[j]) for j in range(len(parts))] for i in range(len(parts))]


def fit(parts: list[dict[str, torch.Tensor]], target: dict[str, torch.Tensor], g: list[list[float]]) -> tuple[list[float], float]:
    """Least-squares weights w with target ~ sum w_i parts_i, and the relative residual."""
    gram = torch.tensor(g, dtype=torch.float64)
    rhs = torch.tensor([_dot(p, target) for p in parts], dtype=torch.float64)
    w = torch.linalg.lstsq(gram, rhs.unsqueeze(1)).solution.squeeze(1).tolist()
    tt = _dot(target, target)
    # |t - Pw|^2 = t.t - 2 w.rhs + w'Gw
    resid2 = tt - 2 * sum(wi * ri for wi, ri in zip(w, rhs.tolist(), strict=True)) + float(
        torch.tensor(w, dtype=torch.float64) @ gram @ torch.tensor(w, dtype=torch.float64))
    return w, math.sqrt(max(resid2, 0.0) / tt) if tt > 0 else math.inf


def classify(k: int, one_step: list[float], stepped: list[float]) -> dict[str, Any] | None:
    """Each slice's weight in train_step's step relative to one step's: 'dropped' (some 0, the rest
    equal), 'weighted' (all positive, unequal), or None (nothing this module can name)."""
    if any(abs(a) <= 1e-6 * max(abs(x) for x in one_step) for a in one_step):
        return None
    rel = [b / a for a, b in zip(one_step, stepped, strict=True)]
    top = max(abs(r) for r in rel)
    if top == 0:
        return None
    kept = [i for i, r in enumerate(rel) if abs(r) > MICRO_EQUAL * top]
    level = sum(rel[i] for i in kept) / len(kept)
    if len(kept) < k and all(abs(rel[i] - level) <= MICRO_EQUAL * abs(level) for i in kept):
        return {"k": k, "kind": "dropped", "weights": rel, "reached": [i + 1 for i in kept]}
    if all(r > 0 for r in rel) and max(rel) - min(rel) > MICRO_EQUAL * top:
        return {"k": k, "kind": "weighted", "weights": rel, "reached": list(range(1, k + 1))}
    return None


def _norm_of(c: list[float], g: list[list[float]]) -> float:
    return math.sqrt(max(sum(c[i] * g[i][j] * c[j] for i in range(len(c)) for j in range(len(c))), 0.0))


def clip_level(rel: list[float], b: list[float], g: list[list[float]]) -> float | None:
    """The max_norm of a clip after every micro-batch's backward, when the step is exactly what one
    makes; else None. rel: each slice's weight relative to one step; b: the step's coefficients on
    the slices' gradients (Gram matrix g).

    A clip after micro-batch j scales the running sum by s_j = min(1, M / its norm), so
    rel_j = s_j ... s_k: s_k = rel_k, s_j = rel_j / rel_(j+1), and the running sum after j is
    sum_(i<=j) b_i / rel_(j+1) g_i. Clipping holds when every s_j <= 1, at least one < 1, each
    clipped running sum has the same norm M and no unclipped one exceeds it."""
    k = len(rel)
    after = [*rel[1:], 1.0]
    if any(x <= 0 for x in after):
        return None
    scale = [rel[j] / after[j] for j in range(k)]
    if any(x <= 0 or x > 1 + MICRO_EQUAL for x in scale):
        return None
    norms = [_norm_of([b[i] / after[j] for i in range(j + 1)], g) for j in range(k)]
    clipped = [norms[j] for j in range(k) if scale[j] < 1 - MICRO_EQUAL]
    if not clipped:
        return None
    level = sorted(clipped)[len(clipped) // 2]
    if all(abs(n - level) <= 0.01 * level for n in clipped) and all(n <= 1.01 * level for n in norms):
        return level
    return None


class BackwardCounter:
    """How many backward passes reached the parameters while it is open (the most any parameter
    got): 1 is a train_step without accumulation, whatever it then does to the gradients."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.counts: dict[int, int] = {}
        self._handles = [p.register_post_accumulate_grad_hook(self._seen) for p in model.parameters() if p.requires_grad]

    def _seen(self, p: torch.Tensor) -> None:
        self.counts[id(p)] = self.counts.get(id(p), 0) + 1

    def close(self) -> int:
        for h in self._handles:
            h.remove()
        return max(self.counts.values(), default=0)


def explain(ctx: RankContext, hooks: tr.Hooks, model: torch.nn.Module, batch: Any, start: dict[str, torch.Tensor],
            stepped: dict[str, torch.Tensor], plain: dict[str, torch.Tensor]) -> dict[str, Any] | None:
    """The slices' weights in train_step's step (see the module), computed from the parameters
    `start` (train_step's starting point) and restored afterwards; None when nothing fits."""
    rows = _rows(batch)
    params = dict(model.named_parameters())
    if rows is None or rows < 2 or sum(p.numel() for p in params.values()) * len(SPLITS) > _CAP:
        return None
    now = {n: p.detach().clone() for n, p in params.items()}
    grads = {n: p.grad for n, p in params.items()}
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    try:
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(start[n])
        for k in (s for s in SPLITS if s <= rows):
            parts = _slice_grads(ctx, hooks, model, batch, k, rows)
            g = gram(parts)
            one, r_one = fit(parts, plain, g)
            mine, r_mine = fit(parts, stepped, g)
            if max(r_one, r_mine) <= FIT_TOLERANCE:
                found = classify(k, one, mine)
                if found is not None and found["kind"] == "weighted" and (level := clip_level(found["weights"], mine, g)) is not None:
                    found = {**found, "kind": "clipped", "max_norm": level}
                return None if found is None else {**found, "resid": max(r_one, r_mine), "rows": rows}
        return None
    except (RuntimeError, ValueError, TypeError, IndexError, KeyError, tr.HookError):
        return None  # the user's loss_fn does not take a slice of the batch: no claim
    finally:
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(now[n])
                p.grad = grads[n]
            for n, b in model.named_buffers():
                b.copy_(buffers[n])
