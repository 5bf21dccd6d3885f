"""The Workload record and the default data-parallel split of a batch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["Workload", "split_batch", "batch_size", "round_up", "fit_world"]


def batch_size(batch: Any) -> int | None:
    """The size of dim 0 shared by the batch's tensors (None when it has no tensor)."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() > 0 else None
    values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (tuple, list)) else ()
    for value in values:
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return value.shape[0]
    return None


def round_up(value: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that is >= `value`."""
    return -(-value // multiple) * multiple


def fit_world(world_size: int, **sizes: int) -> dict[str, int]:
    """Each size rounded up to a multiple of `world_size` (a ValueError names a bad world size).

    What a built-in workload cuts into one piece per rank (the global batch; dim 0 of every
    parameter, which FSDP2 shards) must divide by the world: an uneven split is what
    `split_batch` refuses, and uneven parameter shards are what fsdp_plan warns about. At a
    world size dividing every size the sizes come back unchanged.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    return {name: round_up(value, world_size) for name, value in sizes.items()}


def split_batch(batch: Any, rank: int, world_size: int) -> Any:
    """This rank's contiguous slice along dim 0 of every tensor; other values are kept.

    A tensor, a tuple/list of values or a dict of values. The dim-0 size must divide by
    `world_size` (a ValueError says the sizes otherwise): an uneven split changes what the
    average over ranks means.
    """

    def cut(value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            return value
        size = value.shape[0]
        if size % world_size:
            raise ValueError(
                f"a batch tensor of {size} rows (shape {list(value.shape)}) cannot be split evenly "
                f"across {world_size} ranks; make the global batch size a multiple of {world_size}"
            )
        per = size // world_size
        return value[rank * per : (rank + 1) * per]

    if isinstance(batch, dict):
        return {k: cut(v) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(cut(v) for v in batch)
    return cut(batch)


@dataclass
class Workload:
    """A built-in model, batch and loss, with the same hooks as a user target."""

    name: str
    build_model: Callable[[], nn.Module]
    make_batch: Callable[[int], Any]
    loss_fn: Callable[[nn.Module, Any], torch.Tensor]
    shard_batch: Callable[[Any, int, int], Any]
    blocks: Callable[[nn.Module], list[nn.Module]]
    """The repeated blocks of a model built by build_model (what FSDP2 wraps one by one)."""
    sizes: dict[str, int] = field(default_factory=dict)

    def describe(self) -> str:
        shown = ", ".join(f"{k}={v}" for k, v in self.sizes.items())
        return f"{self.name}({shown})"


def annotate(shard: dict[str, Any], world_size: int, global_count: int) -> dict[str, Any]:
    """Add what a rank's loss needs to normalise by the global batch."""
    out = dict(shard)
    out["world_size"] = world_size
    out["global_count"] = global_count
    return out
