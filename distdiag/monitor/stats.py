"""Tensor statistics the monitor reduces across ranks: grouped norms, code usage, entropy.

Everything here is local to a rank and issues no collective. Norms are returned as squared
sums weighted so that summing them over ranks gives the global value: a plain (replicated,
DDP) tensor counts 1/world on each rank, a DTensor shard counts once, divided by the number
of replicas along its Replicate mesh dimensions (HSDP).
"""

from __future__ import annotations

import math

import torch

__all__ = ["ParamGroups", "code_stats", "entropy_sum", "param_counts"]


def _local_and_weight(t: torch.Tensor, world: int) -> tuple[torch.Tensor, float, bool]:
    """(local tensor, weight in a sum over ranks, is it sharded)."""
    to_local = getattr(t, "to_local", None)
    if callable(to_local):
        replicas = 1
        mesh = t.device_mesh  # type: ignore[attr-defined]
        for dim, placement in enumerate(t.placements):  # type: ignore[attr-defined]
            if placement.is_replicate():
                replicas *= mesh.size(dim)
        return to_local(), 1.0 / replicas, True
    return t, 1.0 / world, False


class ParamGroups:
    """Parameters grouped by the first `depth` parts of their name (`layers.0`, `embed`)."""

    def __init__(self, model: torch.nn.Module, depth: int, world: int) -> None:
        self.world = world
        groups: dict[str, list[torch.nn.Parameter]] = {}
        for name, p in model.named_parameters():
            parts = name.split(".")[:-1] or [name]
            key = ".".join(parts[:depth])
            groups.setdefault(key, []).append(p)
        self.names = list(groups)
        self.params = [p for ps in groups.values() for p in ps]
        self.index: list[int] = [i for i, ps in enumerate(groups.values()) for _ in ps]
        """The group of each parameter of `params`."""
        self.has_plain = any(not callable(getattr(p, "to_local", None)) for p in self.params)
        """Some parameters are plain (replicated) tensors, not DTensors: their norms must agree across ranks."""
        self.device = self.params[0].device if self.params else torch.device("cpu")
        if self.params and callable(getattr(self.params[0], "to_local", None)):
            self.device = self.params[0].to_local().device

    def _grouped(self, tensors: list[torch.Tensor | None]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(per-group weighted sum of squares, plain-tensor sum of squares, non-finite flag)."""
        out = torch.zeros(len(self.names), dtype=torch.float64, device=self.device)
        plain = torch.zeros((), dtype=torch.float64, device=self.device)
        locs, weights, idx, is_plain = [], [], [], []
        for i, t in enumerate(tensors):
            if t is None:
                continue
            loc, w, sharded = _local_and_weight(t.detach(), self.world)
            if loc.numel() == 0:
                continue
            locs.append(loc)
            weights.append(w)
            idx.append(self.index[i])
            is_plain.append(not sharded)
        if not locs:
            return out, plain, torch.zeros((), dtype=torch.float64, device=self.device)
        # one fused kernel for all the norms instead of one per tensor
        norms = torch.stack(torch._foreach_norm(locs)).to(torch.float64)
        sq = norms * norms
        w = torch.tensor(weights, dtype=torch.float64, device=self.device)
        out.index_add_(0, torch.tensor(idx, device=self.device), sq * w)
        mask = torch.tensor(is_plain, device=self.device)
        plain = (sq * mask).sum()
        bad = (~torch.isfinite(norms)).any().to(torch.float64)
        return out, plain, bad

    def grads(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self._grouped([p.grad for p in self.params])

    def values(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self._grouped(list(self.params))

    def snapshot(self) -> list[torch.Tensor]:
        return [_local_and_weight(p.detach(), self.world)[0].clone() for p in self.params]

    def update_sq(self, before: list[torch.Tensor]) -> torch.Tensor:
        """Per-group weighted squared norm of (parameters now - `before`)."""
        diffs, weights, idx = [], [], []
        for i, (p, b) in enumerate(zip(self.params, before, strict=True)):
            loc, w, _ = _local_and_weight(p.detach(), self.world)
            if loc.numel():
                diffs.append(loc - b)
                weights.append(w)  # the parameter's weight (sharded or not), not the diff's
                idx.append(self.index[i])
        out = torch.zeros(len(self.names), dtype=torch.float64, device=self.device)
        if diffs:
            norms = torch.stack(torch._foreach_norm(diffs)).to(torch.float64)
            w = torch.tensor(weights, dtype=torch.float64, device=self.device)
            out.index_add_(0, torch.tensor(idx, device=self.device), norms * norms * w)
        return out


def code_stats(hist: list[float]) -> dict[str, float]:
    """Fraction of codes used, perplexity (exp of the usage entropy) and the top code's share."""
    total = sum(hist)
    if total <= 0:
        return {"used_frac": 0.0, "perplexity": 0.0, "top_share": 0.0, "top_code": -1, "tokens": 0}
    probs = [h / total for h in hist]
    ent = -sum(p * math.log(p) for p in probs if p > 0)
    top = max(range(len(hist)), key=lambda i: hist[i])
    return {
        "used_frac": sum(1 for h in hist if h > 0) / len(hist),
        "perplexity": math.exp(ent),
        "top_share": probs[top],
        "top_code": top,
        "tokens": total,
    }


def entropy_sum(logits: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """Sum over positions of the entropy (nats) of softmax(logits) on the last dim, positions, vocab."""
    flat = logits.detach().reshape(-1, logits.shape[-1]).float()
    logp = torch.log_softmax(flat, dim=-1)
    ent = -(logp.exp() * logp).sum(dim=-1)
    return ent.sum().double(), flat.shape[0], flat.shape[-1]


def param_counts(model: torch.nn.Module) -> list[dict]:
    """Parameters per top-level module (global counts: a DTensor's numel is the full tensor's)."""
    rows: dict[str, dict] = {}
    total = 0
    for name, p in model.named_parameters():
        top = name.split(".")[0] if "." in name else "(root)"
        n = p.numel()
        total += n
        row = rows.setdefault(top, {"module": top, "params": 0, "embedding": False})
        row["params"] += n
    for name, child in model.named_children():
        if name in rows:
            rows[name]["embedding"] = isinstance(child, torch.nn.Embedding | torch.nn.EmbeddingBag) or "emb" in name.lower()
    for row in rows.values():
        row["share"] = row["params"] / total if total else 0.0
    return sorted(rows.values(), key=lambda r: -r["params"])
