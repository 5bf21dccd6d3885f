"""TinyMLP: residual MLP blocks and a classifier head, cross-entropy over samples."""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from distdiag.workloads.base import Workload, annotate, batch_on, fit_world, split_batch

__all__ = ["TinyMLP", "mlp_workload"]


class _Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TinyMLP(nn.Module):
    def __init__(self, dim: int = 16, hidden: int = 32, depth: int = 2, classes: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block(dim, hidden) for _ in range(depth))
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def mlp_workload(
    dim: int = 16, hidden: int = 32, depth: int = 2, classes: int = 4, batch: int = 8, world_size: int = 1,
) -> Workload:
    """TinyMLP on random inputs with random labels (deterministic per step), sized for `world_size` ranks.

    dim, hidden, classes (dim 0 of the parameters) and batch are rounded up to multiples of
    `world_size` (base.fit_world): every rank gets an equal part of the batch and of each
    parameter, at any world size.
    """
    fit = fit_world(world_size, dim=dim, hidden=hidden, classes=classes, batch=batch)
    dim, hidden, classes, batch = fit["dim"], fit["hidden"], fit["classes"], fit["batch"]

    def build_model() -> nn.Module:
        return TinyMLP(dim, hidden, depth, classes)

    def make_batch(step: int) -> dict[str, Any]:
        gen = torch.Generator().manual_seed(10_000 + step)
        x = torch.randn(batch, dim, generator=gen)
        y = torch.randint(0, classes, (batch,), generator=gen)
        return {"x": x, "y": y}

    def shard_batch(batch_: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]:
        return annotate(split_batch(batch_, rank, world_size), world_size, int(batch_["y"].shape[0]))

    def loss_fn(model: nn.Module, shard: dict[str, Any]) -> torch.Tensor:
        shard = batch_on(model, shard)  # the labels too, not only the model's input (docs/targets.md)
        total = F.cross_entropy(model(shard["x"]), shard["y"], reduction="sum")
        return total * shard.get("world_size", 1) / shard.get("global_count", shard["y"].shape[0])

    sizes = {"dim": dim, "hidden": hidden, "depth": depth, "classes": classes, "batch": batch}
    return Workload("mlp", build_model, make_batch, loss_fn, shard_batch, lambda m: list(cast(nn.ModuleList, m.blocks)), sizes)
