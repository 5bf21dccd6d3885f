"""Checksums of what must be equal across ranks: parameter replicas, buffers, RNG states.

param_sync compares them after setup and after each step; determinism compares a step run twice;
shared.py takes them once for all the numerics probes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from distdiag.probes import training as tr

__all__ = ["bit_checksum", "replica_tensors", "snapshot"]

_INT_VIEW = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def bit_checksum(t: torch.Tensor) -> str:
    """A checksum of a tensor's bits (equal bits -> equal checksum), without copying to numpy."""
    if t.device.type == "meta":
        return f"meta-{t.numel()}"  # never materialised: no bits (setup_sync names it)
    t = t.detach().cpu().contiguous().reshape(-1)
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    if t.is_complex():
        t = torch.view_as_real(t).reshape(-1)
    bits = t.view(_INT_VIEW[t.element_size()]).to(torch.int64)
    # Position-weighted sums (wrapping int64 arithmetic): a swap or a flipped bit changes them.
    weights = torch.arange(1, bits.numel() + 1, dtype=torch.int64) * 2654435761 % 2147483647
    return f"{int((bits * weights).sum()) & 0xFFFFFFFFFFFFFFFF:016x}-{int(bits.sum()) & 0xFFFFFFFF:08x}-{bits.numel()}"


def replica_tensors(model: nn.Module, world: int) -> dict[str, tuple[str, torch.Tensor]]:
    """key -> (kind, local tensor) for everything that must be equal on the ranks sharing the key.

    A DTensor's key is its FQN plus its coordinates on the mesh dims it is sharded on: ranks
    that differ only on Replicate dims (HSDP), or that sit in different copies of a mesh
    smaller than the world, hold replicas of the same shard. A key held by one rank only
    (plain FSDP sharding) is not compared.
    """
    from torch.distributed.tensor import DTensor, Replicate

    out: dict[str, tuple[str, torch.Tensor]] = {}
    for name, b in model.named_buffers():
        out[f"buffer {tr.canonical_name(name)}"] = ("buffer", b.to_local() if isinstance(b, DTensor) else b)
    for name, p in model.named_parameters():
        fqn = tr.canonical_name(name)
        if not isinstance(p, DTensor):
            # a parameter that takes no gradient is moved by no optimizer step or reduction: a
            # drift there is an update outside the optimizer (an EMA teacher), told apart below
            out[f"param {fqn}"] = ("unmanaged param" if p.requires_grad else "frozen param", p)
            continue
        mesh = p.device_mesh
        replicated = [d for d, pl in enumerate(p.placements) if isinstance(pl, Replicate)]
        coords: list[int] | tuple[int, ...] = mesh.get_coordinate() or []
        names = mesh.mesh_dim_names or tuple(str(d) for d in range(mesh.ndim))
        where = ",".join(f"{names[d]}={c}" for d, c in enumerate(coords) if d not in replicated)
        if len(replicated) == len(p.placements):
            kind = "replicated param"
        elif replicated:
            kind = "HSDP shard replica"
        elif mesh.size() < world:
            kind = "sub-mesh shard replica"
        else:
            kind = "sharded param"
        out[f"param {fqn}" + (f" [shard {where}]" if where else "")] = (kind, p.to_local())
    return out


def _rng_states() -> dict[str, str]:
    states = {"cpu": bit_checksum(torch.get_rng_state())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = bit_checksum(torch.cuda.get_rng_state())
    return states


def _sum(t: torch.Tensor) -> float:
    return 0.0 if t.device.type == "meta" else float(t.detach().double().sum())


def snapshot(model: nn.Module, world: int) -> dict[str, Any]:
    """Checksums of what must be equal across ranks, and the RNG states (one entry of `snaps`)."""
    tensors = replica_tensors(model, world)
    return {
        "sums": {k: [kind, bit_checksum(t), _sum(t)] for k, (kind, t) in tensors.items()},
        "rng": _rng_states(),
    }
