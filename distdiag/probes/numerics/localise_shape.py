"""The shape of a difference between a module's output on a rank and the reference's on the same inputs.

Each reading is a fact about the two tensors, checked on its own, not a guess at the cause:
a constant factor (and whether it is the world size or its inverse), elements zeroed while
the rest are scaled by one constant (what dropout does), another dtype (the outputs'
dtypes), the same values in another order, and which rows (dim 0) differ. localise.py
records them; localise_read.py turns them, with the reruns, into a finding's words.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["difference_shape", "rel_err", "world_relation"]

FACTOR_RESID = 1e-3
"""A difference that is the reference times one constant leaves at most this (float32 rounding is ~1e-6)."""
_WORK = torch.float32


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in float32 at least (infinite where a value is not finite)."""
    work = torch.float64 if torch.float64 in (got.dtype, want.dtype) else _WORK
    g, w = got.detach().to(work), want.detach().to(work)
    diff = float((g - w).norm())
    if not math.isfinite(diff):
        return math.inf
    return diff / max(float(w.norm()), 1e-12)


def world_relation(factor: float, world: int) -> str:
    """'the world size' / 'one over the world size' / '' for a factor that is neither (within 1e-4)."""
    if world > 1 and abs(factor / world - 1) < 1e-4:
        return "the world size"
    if world > 1 and abs(factor * world - 1) < 1e-4:
        return "one over the world size"
    return ""


def _factor(g: torch.Tensor, w: torch.Tensor) -> tuple[float, float]:
    ww = float(torch.dot(w, w))
    if ww <= 0:
        return 0.0, math.inf
    f = float(torch.dot(g, w)) / ww
    return f, float((g - f * w).norm()) / max(abs(f) * math.sqrt(ww), 1e-300)


def _dropout(g: torch.Tensor, w: torch.Tensor) -> dict[str, float] | None:
    """Some elements exactly zero where the reference's are not, every other one the reference's times one c > 1
    (dropout's 1 / (1 - p)): {"p": 1 - 1/c, "zeroed": the share zeroed}."""
    live = w.abs() > 1e-6 * float(w.abs().max())
    zeroed = live & (g == 0)
    kept = live & (g != 0)
    if not bool(zeroed.any()) or int(kept.sum()) < 2:
        return None
    ratio = g[kept] / w[kept]
    c = float(ratio.median())
    if c <= 1 or float((ratio - c).abs().max()) > 1e-3 * c:
        return None
    return {"p": 1 - 1 / c, "zeroed": float(zeroed.sum()) / max(int(live.sum()), 1)}


def _rows(got: torch.Tensor, want: torch.Tensor, tol: float) -> list[int] | None:
    """[rows that differ, rows] along dim 0, for a tensor of two or more dims."""
    if got.dim() < 2 or got.shape[0] < 2:
        return None
    g, w = got.detach().to(_WORK).reshape(got.shape[0], -1), want.detach().to(_WORK).reshape(want.shape[0], -1)
    per_row = (g - w).norm(dim=1) / w.norm(dim=1).clamp_min(1e-12)
    return [int((per_row > tol).sum()), got.shape[0]]


def difference_shape(got: torch.Tensor, want: torch.Tensor, world: int, tol: float) -> dict[str, Any]:
    """Every reading that holds of got (a rank's module output) against want (the reference's on the same inputs)."""
    out: dict[str, Any] = {}
    if got.dtype != want.dtype:
        out["dtype"] = [str(want.dtype).replace("torch.", ""), str(got.dtype).replace("torch.", "")]
    g, w = got.detach().to(_WORK).reshape(-1), want.detach().to(_WORK).reshape(-1)
    if not (torch.isfinite(g).all() and torch.isfinite(w).all()):
        out["non_finite"] = True
        return out
    f, resid = _factor(g, w)
    if resid <= FACTOR_RESID and abs(f - 1) > tol:
        out["factor"] = f
        if relation := world_relation(f, world):
            out["factor_is"] = relation
    if (drop := _dropout(g, w)) is not None:
        out["dropout"] = drop
    if "factor" not in out and g.numel() > 1 and rel_err(g.sort().values, w.sort().values) <= tol:
        out["permuted"] = True
    if (rows := _rows(got, want, tol)) is not None:
        out["rows"] = rows
    return out
