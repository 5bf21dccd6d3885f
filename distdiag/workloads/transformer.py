"""TinyTransformer: a pre-norm causal language model, loss summed over valid tokens."""

from __future__ import annotations

import math
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from distdiag.workloads.base import Workload, annotate, batch_on, fit_world, split_batch

__all__ = ["TinyTransformer", "transformer_workload"]


class _Layer(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.mlp_norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(out.transpose(1, 2).reshape(b, s, d))
        return x + self.down(F.gelu(self.up(self.mlp_norm(x))))


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int = 32, dim: int = 16, heads: int = 2, layers: int = 2, seq: int = 8) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim ({dim}) must be a multiple of heads ({heads})")
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.layers = nn.ModuleList(_Layer(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        # A buffer that must be equal on every rank (param_sync checks buffers).
        self.register_buffer("scale", torch.tensor(dim**-0.5 * 4.0))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x) * self.scale)


def transformer_workload(
    vocab: int = 32, dim: int = 16, heads: int = 2, layers: int = 2, seq: int = 8, batch: int = 8, world_size: int = 1,
) -> Workload:
    """TinyTransformer on random tokens, sized for `world_size` ranks; row i keeps a different number of valid targets.

    vocab, seq (dim 0 of the embedding and position parameters) and batch are rounded up to
    multiples of `world_size`, and dim to a multiple of both `world_size` and `heads`
    (base.fit_world): every rank gets an equal part of the batch and of each parameter.
    """
    fit = fit_world(world_size, vocab=vocab, seq=seq, batch=batch)
    vocab, seq, batch = fit["vocab"], fit["seq"], fit["batch"]
    dim = fit_world(math.lcm(world_size, heads), dim=dim)["dim"]

    def build_model() -> nn.Module:
        return TinyTransformer(vocab, dim, heads, layers, seq)

    def make_batch(step: int) -> dict[str, Any]:
        gen = torch.Generator().manual_seed(20_000 + step)
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
        # Uneven valid lengths (padding at the end): ranks hold different token counts.
        lengths = 1 + (torch.arange(batch) * 5 + step) % seq
        mask = torch.arange(seq)[None, :] < lengths[:, None]
        return {"tokens": tokens, "mask": mask}

    def shard_batch(batch_: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]:
        return annotate(split_batch(batch_, rank, world_size), world_size, int(batch_["mask"].sum()))

    def loss_fn(model: nn.Module, shard: dict[str, Any]) -> torch.Tensor:
        shard = batch_on(model, shard)  # the targets and the mask too, not only the input (docs/targets.md)
        tokens, mask = shard["tokens"], shard["mask"]
        logits = model(tokens[:, :-1])
        per_token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1), reduction="none")
        total = (per_token * mask.reshape(-1)).sum()
        # Not shard.get(..., int(mask.sum())): the default would be computed on every call, a
        # device-to-host copy (a GPU sync) per loss even when the shard carries the count.
        count = shard["global_count"] if "global_count" in shard else int(mask.sum())
        return total * shard.get("world_size", 1) / count

    sizes = {"vocab": vocab, "dim": dim, "heads": heads, "layers": layers, "seq": seq, "batch": batch}
    return Workload("transformer", build_model, make_batch, loss_fn, shard_batch, lambda m: list(cast(nn.ModuleList, m.layers)), sizes)
