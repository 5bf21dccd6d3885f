"""Tensor statistics the monitor reduces across ranks: grouped norms, code usage, entropy.

Everything here is local to a rank and issues no collective. Norms are returned as squared
sums weighted so that summing them over ranks gives the global value: a plain (replicated,
DDP) tensor counts 1/world on each rank, a DTensor shard counts once, divided by the number
of replicas along its Replicate mesh dimensions (HSDP).
"""

from __future__ import annotations

import math

import torch

__all__ = ["ParamGroups", "code_stats", "embedding_modules", "entropy_sum", "param_counts"]


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
        self.units, slots = _same_kind_units(model, self.params)
        """kind -> names of the parameters of that kind (the same projection of each layer), in
        the order of their slots after the groups in the norm vectors."""
        self.unit_index = [len(self.names) + u if u >= 0 else -1 for u in slots]
        """For each parameter of `params` its slot in the norm vectors after the groups (-1: none)."""
        self.width = len(self.names) + sum(len(v) for v in self.units.values())
        """Length of the grouped vectors: a sum per group, then one per same-kind parameter."""
        self.has_plain = any(not callable(getattr(p, "to_local", None)) for p in self.params)
        """Some parameters are plain (replicated) tensors, not DTensors: their norms must agree across ranks."""
        self.device = self.params[0].device if self.params else torch.device("cpu")
        if self.params and callable(getattr(self.params[0], "to_local", None)):
            self.device = self.params[0].to_local().device  # type: ignore[attr-defined]  # a DTensor parameter's

    def _grouped(self, tensors: list[torch.Tensor | None]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(per-group weighted sum of squares, plain-tensor sum of squares, non-finite flag)."""
        out = torch.zeros(self.width, dtype=torch.float64, device=self.device)
        plain = torch.zeros((), dtype=torch.float64, device=self.device)
        locs, weights, idx, is_plain, unit = [], [], [], [], []
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
            unit.append(self.unit_index[i])
        if not locs:
            return out, plain, torch.zeros((), dtype=torch.float64, device=self.device)
        # one fused kernel for all the norms instead of one per tensor
        norms = torch.stack(torch._foreach_norm(locs)).to(torch.float64)
        sq = norms * norms
        ws = torch.tensor(weights, dtype=torch.float64, device=self.device)
        out.index_add_(0, torch.tensor(idx, device=self.device), sq * ws)
        if any(u >= 0 for u in unit):
            keep = torch.tensor([u >= 0 for u in unit], device=self.device)
            slots = torch.tensor([max(u, 0) for u in unit], device=self.device)
            out.index_add_(0, slots[keep], (sq * ws)[keep])
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
        # the same-kind slots stay 0 here: only the groups' update norms are read
        out = torch.zeros(self.width, dtype=torch.float64, device=self.device)
        if diffs:
            norms = torch.stack(torch._foreach_norm(diffs)).to(torch.float64)
            ws = torch.tensor(weights, dtype=torch.float64, device=self.device)
            out.index_add_(0, torch.tensor(idx, device=self.device), norms * norms * ws)
        return out


def _same_kind_units(model: torch.nn.Module, params: list[torch.nn.Parameter]) -> tuple[dict[str, list[str]], list[int]]:
    """Parameters of the same kind: the same name once layer indices are left out, and the same
    shape, in at least two layers (`layers.3.self_attn.q_proj.weight` and the other layers'). Gradient
    norms are comparable within a kind; a whole layer stack against one norm vector is not."""
    kind_of: dict[int, tuple[str, str]] = {}
    for mname, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            full = f"{mname}.{pname}" if mname else pname
            # the role is the name with the layer indices left out: layers.*.self_attn.q_proj.weight
            role = ".".join("*" if part.isdigit() else part for part in full.split("."))
            if id(p) not in kind_of:
                kind_of[id(p)] = (f"{role}{list(p.shape)}", full)
    members: dict[str, list[int]] = {}
    for i, p in enumerate(params):
        if id(p) in kind_of:
            members.setdefault(kind_of[id(p)][0], []).append(i)
    units: dict[str, list[str]] = {}
    slot = [-1] * len(params)
    n = 0
    for kind, idx in members.items():
        if len(idx) < 2:
            continue
        units[kind] = [kind_of[id(params[i])][1] for i in idx]
        for i in idx:
            slot[i] = n
            n += 1
    return units, slot


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


def entropy_sum(logits: torch.Tensor) -> tuple[torch.Tensor, int, int, torch.Tensor]:
    """Sum over positions of the entropy (nats) of softmax(logits) on the last dim, positions,
    vocab, and the entropy of the mean distribution over the positions (the marginal: low only
    when every position predicts the same few tokens, not when each is confident of its own)."""
    flat = logits.detach().reshape(-1, logits.shape[-1]).float()
    logp = torch.log_softmax(flat, dim=-1)
    probs = logp.exp()
    ent = -(probs * logp).sum(dim=-1)
    marginal = probs.mean(dim=0)
    marg = -(marginal * torch.log(marginal.clamp_min(1e-30))).sum()
    return ent.sum().double(), flat.shape[0], flat.shape[-1], marg.double()


def _subtree_counts(model: torch.nn.Module) -> tuple[dict[str, int], int]:
    """Parameters under each module name ("" the root), each shared tensor counted once
    (global counts: a DTensor's numel is the full tensor's)."""
    counts: dict[str, int] = {}
    total = 0
    for name, p in model.named_parameters():  # deduplicates tied weights
        n = p.numel()
        total += n
        parts = name.split(".")[:-1]
        for k in range(len(parts) + 1):
            key = ".".join(parts[:k])
            counts[key] = counts.get(key, 0) + n
    return counts, total


def _is_stack(module: torch.nn.Module) -> bool:
    """A list of blocks of one class (the layers of a transformer): reported as one row."""
    kids = list(module.children())
    return isinstance(module, torch.nn.ModuleList | torch.nn.Sequential) and len(kids) > 1 and len({type(k) for k in kids}) == 1


def param_counts(model: torch.nn.Module) -> list[dict]:
    """The modules that hold the parameters, at whatever depth: starting from the top-level
    children, a row holding at least half of the parameters is replaced by its children
    (a wrapper such as LlamaForCausalLM.model is seen through), except a stack of blocks of
    one class, which stays one row. Largest first."""
    counts, total = _subtree_counts(model)
    modules = dict(model.named_modules())
    own = {name: sum(p.numel() for p in m.parameters(recurse=False)) for name, m in modules.items()}

    def children(name: str) -> list[str]:
        kids = [f"{name}.{c}" if name else c for c, _ in modules[name].named_children()]
        rows = [k for k in kids if counts.get(k, 0) > 0]
        return ([f"{name}:own"] if name and own.get(name) and rows else []) + rows

    rows = children("") + (["(root)"] if own.get("") else [])
    while True:
        big = next((r for r in rows if r in modules and counts.get(r, 0) * 2 >= total and children(r) and not _is_stack(modules[r])), None)
        if big is None:
            break
        i = rows.index(big)
        rows[i : i + 1] = children(big)
    emb = set(embedding_modules(model)[0])
    out = []
    for r in rows:
        n = own[""] if r == "(root)" else own[r[: -len(":own")]] if r.endswith(":own") else counts.get(r, 0)
        m = modules.get(r)
        label = f"{r} ({len(list(m.children()))} x {type(next(m.children())).__name__})" if m is not None and _is_stack(m) else r
        if r.endswith(":own"):
            label = f"{r[: -len(':own')]} (its own parameters)"
        out.append({"module": label, "params": n, "embedding": r in emb, "share": n / total if total else 0.0})
    return sorted(out, key=lambda row: -row["params"])


def embedding_modules(model: torch.nn.Module) -> tuple[list[str], int]:
    """The lookup tables and the output projection onto their vocabulary, and the parameters they
    hold (shared ones once). The output projection is what a Hugging Face model's
    get_output_embeddings() returns, else a Linear with a table's shape outside any stack of
    layers (an MLP projection of layer 3 may have the same shape by chance)."""
    modules = list(model.named_modules())
    by_name = dict(modules)
    is_table = {name for name, m in modules if isinstance(m, torch.nn.Embedding | torch.nn.EmbeddingBag)}
    shapes = {tuple(m.weight.shape) for name, m in modules if name in is_table}
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    names, seen, n = [], set(), 0
    for name, m in modules:
        parts = name.split(".")
        in_stack = any(_is_stack(by_name[".".join(parts[:k])]) for k in range(1, len(parts)))
        lm_head = m is head if head is not None else isinstance(m, torch.nn.Linear) and tuple(m.weight.shape) in shapes and not in_stack
        if name in is_table or lm_head:
            names.append(name)
            for p in m.parameters(recurse=False):
                if id(p) not in seen:
                    seen.add(id(p))
                    n += p.numel()
    return names, n
