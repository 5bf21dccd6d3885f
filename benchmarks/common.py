"""Workloads the benchmarks share (run them as `python benchmarks/NAME.py`, which puts this
folder on sys.path)."""

from __future__ import annotations

from typing import Any


def fsdp_mlp(width: int = 128, depth: int = 4) -> Any:
    """A small MLP under FSDP2, one fully_shard per block plus the root, seeded identically."""
    import torch
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU()) for _ in range(depth)]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(width, 8))
    for layer in layers:
        fully_shard(layer)
    fully_shard(model)
    return model
