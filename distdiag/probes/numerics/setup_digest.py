"""setup_sync's evidence: per-tensor digests of the model as built, and what their differences mean.

Each rank digests every parameter and buffer of the model `build_model` returns (before
`parallelize`): the bit checksum (equal bits -> equal checksum), sum, sum of squares and an
evenly strided sample of SAMPLE elements, taken at the same positions on every rank. Only
the digests travel (in the payload), never a tensor; the sample bounds the max abs
difference and estimates how many elements differ (exact for tensors of at most SAMPLE
elements). `classify` turns the tensors that differ into one mechanism (a `cause`).
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass, field
from typing import TypedDict

import torch
from torch import nn

from distdiag.probes.base import group_ranks
from distdiag.probes.causes import ProbeCause

__all__ = ["SAMPLE", "TensorDigest", "byte_hash", "digest_model", "Divergence", "classify", "outermost_modules", "sample_diff"]

SAMPLE = 64
"""Strided sample size per tensor: 64 floats per tensor keep a 1000-tensor model's payload
under 1 MB, and a tensor of that many elements or fewer is compared element by element."""


def _device(t: torch.Tensor) -> str:
    d = t.device
    return d.type if d.index is None else f"{d.type}:{d.index}"


def byte_hash(t: torch.Tensor) -> str:
    """A hash of the tensor's bytes: equal bits, equal hash (3.5x faster than replicas.bit_checksum
    on a 130 MiB model: no int64 copies)."""
    raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    # an ndarray is a buffer; numpy's stubs say so only for Python >= 3.12
    return hashlib.blake2b(memoryview(raw), digest_size=16).hexdigest() + f"-{t.numel()}"  # type: ignore[arg-type]


class TensorDigest(TypedDict, total=False):
    """One tensor as setup_sync compares it across ranks (the values are absent on meta)."""

    kind: str
    """param, sharded param or buffer."""
    dtype: str
    device: str
    shape: list[int]
    numel: int
    trainable: bool
    bits: str
    """byte_hash of its bytes."""
    sum: float
    sumsq: float
    sample: list[float]
    """Up to SAMPLE elements at evenly spaced indices."""


def _digest(t: torch.Tensor, kind: str, trainable: bool) -> TensorDigest:
    out: TensorDigest = {
        "kind": kind, "dtype": str(t.dtype).replace("torch.", ""), "device": _device(t),
        "shape": list(t.shape), "numel": t.numel(), "trainable": trainable,
    }
    if t.device.type == "meta":
        return out  # no values yet (deferred init): nothing to compare
    flat = t.detach().reshape(-1)
    if flat.is_complex():
        flat = flat.abs()
    n = flat.numel()
    idx = torch.arange(n, device=flat.device) if n <= SAMPLE else torch.linspace(0, n - 1, SAMPLE, device=flat.device).long()
    out["bits"] = byte_hash(t)
    out["sum"] = float(flat.sum(dtype=torch.float64)) if n else 0.0
    out["sumsq"] = float(torch.linalg.vector_norm(flat, dtype=torch.float64) ** 2) if n and flat.is_floating_point() else 0.0
    out["sample"] = [float(v) for v in flat[idx].double().cpu()]
    return out


def digest_model(model: nn.Module) -> dict[str, TensorDigest]:
    """FQN -> digest of every parameter and buffer (a DTensor: its local shard, marked sharded)."""
    from distdiag.probes import training as tr

    out: dict[str, TensorDigest] = {}
    for name, p in model.named_parameters():
        sharded = hasattr(p, "placements") and any(not pl.is_replicate() for pl in p.placements)
        out[tr.canonical_name(name)] = _digest(tr.local_tensor(p), "sharded param" if sharded else "param", p.requires_grad)
    for name, b in model.named_buffers():
        out[tr.canonical_name(name)] = _digest(tr.local_tensor(b), "buffer", False)
    return out


def sample_diff(a: TensorDigest, b: TensorDigest) -> tuple[float, int, int]:
    """(max abs difference, differing elements, sampled elements) between two digests' samples."""
    pairs = list(zip(a.get("sample", []), b.get("sample", []), strict=False))
    # NaN on one side only is an infinite difference; NaN on both is equal.
    diffs = [abs(x - y) if (x == x and y == y) else math.inf for x, y in pairs if x != y and not (x != x and y != y)]
    return (max(diffs) if diffs else 0.0), len(diffs), len(pairs)


def outermost_modules(names: list[str], every: list[str]) -> list[str]:
    """The outermost modules all of whose tensors are in ``names`` (a tensor of the root: itself)."""
    chosen: list[str] = []
    bad = set(names)
    for name in sorted(names):
        parts = name.split(".")
        pick = name
        for depth in range(1, len(parts)):
            prefix = ".".join(parts[:depth])
            if all(n in bad for n in every if n.startswith(prefix + ".")):
                pick = prefix
                break
        if pick not in chosen:
            chosen.append(pick)
    return chosen


@dataclass
class Divergence:
    """What the tensors that differ at build time say about the mechanism."""

    cause: ProbeCause
    odd: list[int]
    """The ranks named: the one rank that differs, or every rank that disagrees."""
    reason: str
    """The deciding evidence, in words with counts."""
    confidence: float
    groups: dict[str, dict[str | None, list[int]]] = field(default_factory=dict)


def _random_looking(d: TensorDigest) -> bool:
    sample = d.get("sample") or []
    return d["kind"] != "buffer" and len(set(sample)) > 1



def _bits(digests: dict[int, dict[str, TensorDigest]], key: str, rank: int) -> str | None:
    """The bits digest of `key` on `rank` (None: not taken)."""
    return digests[rank][key].get("bits")


def classify(digests: dict[int, dict[str, TensorDigest]], differing: list[str]) -> Divergence:
    """One mechanism for the tensors in ``differing`` (each compared across the ranks holding it).

    One rank differing from all the others (which agree) on every such tensor: a value written
    on that rank only (a checkpoint loaded on rank 0). Every rank distinct on every such tensor
    and no randomly initialised parameter left equal: each rank drew its own init (rank-seeded).
    Only buffers: a buffer computed per rank. With 2 ranks "one rank differs" cannot be told
    from "all differ", so coverage decides: the rank-seeded init changes every randomly
    initialised parameter, a load on one rank only those it loads.
    """
    ranks = sorted(digests)
    groups = {k: group_ranks([r for r in ranks if k in digests[r]], functools.partial(_bits, digests, k)) for k in differing}
    if all(digests[ranks[0]].get(k, {}).get("kind") == "buffer" for k in differing):
        return Divergence(ProbeCause.SETUP_DIVERGENCE_BUFFER_PER_RANK, _disagreeing(groups), "only buffers differ, every parameter agrees", 0.85, groups)
    if _permuted(digests, ranks, differing):
        return Divergence(
            ProbeCause.SETUP_DIVERGENCE_INIT_ORDER, _disagreeing(groups),
            f"the {len(differing)} tensor(s) hold the same values on every rank, under different names: each rank drew "
            "the same initial values and gave them to its modules in another order (modules built or initialised "
            "in an order that differs across ranks)", 0.85, groups)
    partial = _partial(digests, groups)
    if partial:
        lone = {tuple(_one_odd(g)) for g in groups.values()}
        return Divergence(
            ProbeCause.SETUP_DIVERGENCE_PARTIAL_TENSOR,
            list(next(iter(lone))) if len(ranks) >= 3 and len(lone) == 1 and next(iter(lone)) else _disagreeing(groups),
            f"only part of each tensor differs ({partial}): rows or a slice written on some ranks after init, not the "
            "whole tensor (a checkpoint load or a rank-seeded init changes every element); candidates: an embedding "
            "built with padding_idx on some ranks only (its pad row zeroed), a special token's row initialised per "
            "rank, a partial load (strict=False) on some ranks; what would decide: the indices where the ranks' copies "
            "differ, (t_rank0 != t_rank1).nonzero() on the model as built", 0.75, groups)
    odd = {tuple(_one_odd(g)) for g in groups.values()}
    if len(ranks) >= 3 and len(odd) == 1 and next(iter(odd)):
        (rank,) = next(iter(odd))
        return Divergence(
            ProbeCause.SETUP_DIVERGENCE_LOADED_ON_ONE_RANK, [rank],
            f"on each of the {len(differing)} tensor(s) rank {rank} alone differs and the other {len(ranks) - 1} ranks agree",
            0.9, groups)
    random_params = [k for k, d in digests[ranks[0]].items() if _random_looking(d)]
    left_equal = [k for k in random_params if k not in differing]
    distinct = all(len(g) == sum(len(m) for m in g.values()) for g in groups.values())
    if distinct and not left_equal:
        return Divergence(
            ProbeCause.SETUP_DIVERGENCE_RANK_SEEDED, _disagreeing(groups),
            f"every rank holds its own values and all {len(random_params)} randomly initialised parameter(s) differ",
            0.85 if len(ranks) >= 3 else 0.7, groups)
    if distinct and len(ranks) == 2:
        return Divergence(
            ProbeCause.SETUP_DIVERGENCE_LOADED_ON_ONE_RANK, _disagreeing(groups),
            f"{len(differing)} tensor(s) differ while {len(left_equal)} other randomly initialised parameter(s) agree: "
            "values written after init on one of the two ranks (with 2 ranks which one cannot be told; at 3 or more "
            "ranks the odd one is named)", 0.7, groups)
    return Divergence(ProbeCause.SETUP_DIVERGENCE, _disagreeing(groups), "ranks fall into several groups of equal values", 0.6, groups)


PARTIAL_SHARE = 0.25
"""At most this share of a tensor's sampled elements differing is 'part of the tensor' (a row, a slice)."""


def _partial(digests: dict[int, dict[str, TensorDigest]], groups: dict[str, dict[str | None, list[int]]]) -> str:
    """'x of y sampled elements' per tensor when every differing tensor differs in at most PARTIAL_SHARE of its
    sampled elements (with at least 16 sampled), else ''."""
    shown = []
    for key, g in groups.items():
        members = list(g.values())
        if len(members) < 2:
            return ""
        a, b = digests[members[0][0]][key], digests[members[1][0]][key]
        _, ndiff, nsampled = sample_diff(a, b)
        if nsampled < 16 or ndiff > PARTIAL_SHARE * nsampled:
            return ""
        shown.append(f"{key}: {ndiff} of {nsampled} sampled elements")
    return "; ".join(shown[:4]) + (f"; +{len(shown) - 4} more" if len(shown) > 4 else "")


def _permuted(digests: dict[int, dict[str, TensorDigest]], ranks: list[int], differing: list[str]) -> bool:
    """Every rank holds the same multiset of values (shape, dtype, bits) over the differing tensors:
    the values moved between names, none is new (at least two tensors, on every rank)."""
    if len(differing) < 2 or any(k not in digests[r] for r in ranks for k in differing):
        return False

    def bag(r: int) -> list[tuple[str, str, str]]:
        return sorted((str(digests[r][k]["shape"]), digests[r][k]["dtype"], str(digests[r][k].get("bits"))) for k in differing)

    first = bag(ranks[0])
    return all(bag(r) == first for r in ranks[1:])


def _one_odd(groups: dict[str | None, list[int]]) -> list[int]:
    sizes = sorted(len(g) for g in groups.values())
    if len(groups) == 2 and sizes[0] == 1 and sizes[1] >= 2:
        return next(g for g in groups.values() if len(g) == 1)
    return []


def _disagreeing(groups: dict[str, dict[str | None, list[int]]]) -> list[int]:
    return sorted({r for g in groups.values() if len(g) > 1 for members in g.values() for r in members})
