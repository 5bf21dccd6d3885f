"""The Workload record and the default data-parallel split of a batch."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["Workload", "split_batch", "batch_size", "round_up", "fit_world", "model_device", "to_device", "batch_on"]


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


def model_device(model: nn.Module) -> torch.device | None:
    """The device `model` computes on: that of its first parameter (else buffer); None without any.

    A DTensor kept on another device than its mesh's (FSDP2's CPU offload keeps the shards on
    the CPU and computes on the mesh's GPU) computes on the mesh's device: the current one of
    that type (the rank's GPU, which distdiag selects with torch.cuda.set_device).
    """
    for t in itertools.chain(model.parameters(), model.buffers()):
        mesh = getattr(t, "device_mesh", None)
        kind = getattr(mesh, "device_type", None)
        if isinstance(kind, str) and kind != t.device.type:
            module: Any = getattr(torch, kind, None)  # torch.cuda, torch.xpu, ...
            index = module.current_device() if hasattr(module, "current_device") else None
            return torch.device(kind, index) if index is not None else torch.device(kind)
        return t.device
    return None


def to_device(batch: Any, device: torch.device | str | None) -> Any:
    """`batch` with every tensor on `device`, however deeply it sits in dicts, tuples and lists.

    The containers are rebuilt with their own types (a namedtuple, a dict subclass such as Hugging
    Face's BatchEncoding); other values are kept as they are. A tensor already there is not copied.
    `device` None returns the batch unchanged.
    """
    if device is None:
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        moved = {k: to_device(v, device) for k, v in batch.items()}
        try:
            return type(batch)(moved)  # type: ignore[call-arg]  # a Mapping subclass's own constructor, tried
        except Exception:  # noqa: BLE001 - a mapping type that cannot be rebuilt from a dict
            return moved
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(to_device(v, device) for v in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def batch_on(model: nn.Module, batch: Any) -> Any:
    """`batch` on the device `model` computes on (model_device): what every loss_fn and
    train_step receives (docs/targets.md, "Devices"). FSDP2 moves a forward's inputs itself,
    but not the targets and masks a loss reads beside the model's output."""
    return to_device(batch, model_device(model))


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
