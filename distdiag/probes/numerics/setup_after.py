"""Does a difference seen at build time reach the model that trains?

`parallelize` may heal it (DDP broadcasts rank 0's state at construction; a user may
broadcast before fully_shard, or load a checkpoint after it), or carry it into training
(fully_shard keeps each rank's slice of its own copy). Two small all_reduces tell every rank
which tensors differ at build time (`differing_names`); after parallelize each rank hashes,
for those tensors only, what it now holds and the same slice of its own build-time copy,
and rank 0 the slice every other rank holds of *its* copy (`after_parallel`). `reach`
decides per tensor in consolidation.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, TypedDict

import torch
from torch import nn

from distdiag.probes import training as tr
from distdiag.probes.numerics.setup_digest import TensorDigest, byte_hash

if TYPE_CHECKING:
    from torch.distributed.tensor import Placement

    from distdiag.runtime.context import RankContext

__all__ = ["AfterParallel", "differing_names", "after_parallel", "reach"]


def _int63(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") >> 1


def _spread(ctx: RankContext, values: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(max, min) over ranks of each value, in one all_reduce(MAX) of [v, -v]."""
    t = torch.tensor(values + [-v for v in values], dtype=torch.int64, device=ctx.device)
    ctx.comm.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    n = len(values)
    return t[:n].cpu(), -t[n:].cpu()


def differing_names(ctx: RankContext, digests: dict[str, TensorDigest] | None) -> list[str] | None:
    """The tensors whose bits differ across ranks (the same list on every rank), or None when the
    ranks do not hold the same names (or one failed to build): then nothing more is compared.
    Every rank issues the same two all_reduces whatever it holds."""
    names = sorted(digests) if digests is not None else []
    head = [len(names), _int63("\n".join(names))] if digests is not None else [-1, -1]
    hi, lo = _spread(ctx, head)
    same = bool((hi == lo).all()) and head[0] >= 0
    values = [_int63(digests[n].get("bits", "")) for n in names] if same and digests is not None else []
    hi, lo = _spread(ctx, values if same else [0])
    if not same:
        return None
    return [n for n, a, b in zip(names, hi.tolist(), lo.tolist(), strict=True) if a != b]


def _slice(full: torch.Tensor, placements: Sequence[Placement], coord: list[int], shape: list[int]) -> torch.Tensor | None:
    """The part of `full` a rank at mesh coordinate `coord` holds (torch.chunk per Shard dim, as
    DTensor splits), or None for a placement this does not model (strided or partial)."""
    from torch.distributed.tensor import Replicate, Shard

    part = full
    for mesh_dim, pl in enumerate(placements):
        if isinstance(pl, Replicate):
            continue
        if type(pl) is not Shard:
            return None
        chunks = torch.chunk(part, shape[mesh_dim], dim=pl.dim)
        index = coord[mesh_dim]
        part = chunks[index] if index < len(chunks) else part.narrow(pl.dim, 0, 0)
    return part


class AfterParallel(TypedDict, total=False):
    """One tensor after parallelize, as byte_hash digests: `full` when every rank holds all of
    it; else the rank's `local` shard, `own` (the same slice of its model as built), and on
    rank 0 `r0` (rank -> that rank's slice of rank 0's copy)."""

    full: str
    local: str
    own: str | None
    r0: dict[str, str | None]


def after_parallel(ctx: RankContext, built: nn.Module, model: nn.Module, names: list[str]) -> dict[str, AfterParallel]:
    """For each tensor in ``names``: what this rank holds after parallelize, and its own slice."""
    wanted = set(names)
    before = {tr.canonical_name(n): t for n, t in list(built.named_parameters()) + list(built.named_buffers())}
    out: dict[str, AfterParallel] = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        key = tr.canonical_name(name)
        if key not in wanted or key not in before or t.device.type == "meta":
            continue
        local = tr.local_tensor(t)
        if not hasattr(t, "placements") or all(p.is_replicate() for p in t.placements):
            out[key] = {"full": byte_hash(local)}
            continue
        mesh = t.device_mesh  # type: ignore[attr-defined]  # a DTensor (it has placements)
        coord = mesh.get_coordinate() or []
        own = _slice(before[key].detach(), t.placements, coord, list(mesh.shape))
        entry: AfterParallel = {"local": byte_hash(local), "own": byte_hash(own) if own is not None else None}
        if ctx.rank == 0 and own is not None:
            entry["r0"] = {}
            for rank in mesh.mesh.flatten().tolist():
                where = (mesh.mesh == rank).nonzero()[0].tolist()
                part = _slice(before[key].detach(), t.placements, where, list(mesh.shape))
                entry["r0"][str(rank)] = byte_hash(part) if part is not None else None
        out[key] = entry
    return out


def reach(key: str, after: dict[int, dict[str, AfterParallel]]) -> str | None:
    """"carried" (a rank trains on its own differing values), "healed" (every rank now holds the
    same values, or its slice of rank 0's copy), "rewritten" (parallelize replaced them all: a
    load or init after sharding), or None (not known)."""
    entries = {r: e for r, a in after.items() if (e := a.get(key)) is not None}
    if len(entries) < len(after):
        return None
    if all("full" in e for e in entries.values()):
        return "healed" if len({e["full"] for e in entries.values()}) == 1 else "carried"
    if any("local" not in e or e["own"] is None for e in entries.values()):
        return None
    r0 = (entries.get(0) or {}).get("r0") or {}
    if all(r0.get(str(r)) == e["local"] for r, e in entries.items()):
        return "healed"  # the sharded model is rank 0's copy
    if all(e["local"] == e["own"] for e in entries.values()):
        return "carried"  # each rank kept its slice of its own copy
    kept = [r for r, e in entries.items() if e["local"] == e["own"]]
    if any(r0.get(str(r)) != entries[r]["own"] for r in kept):
        return "carried"
    return "rewritten"
