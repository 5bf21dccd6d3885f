"""Row hashes of a batch, and what comparing them across ranks and epochs says.

A batch (a tensor, or a tuple/list/dict of values) is cut into rows along dim 0: row i is
row i of every tensor whose dim 0 is the batch size. A row's hash covers its bytes in all
those tensors, so two ranks given the same sample (same tokens, same label) hash it alike
whatever order or batch it comes in. Only hashes travel; no data leaves a rank.
"""

from __future__ import annotations

import bisect
import hashlib
from dataclasses import dataclass, field
from itertools import combinations
from typing import Any

import torch

__all__ = ["row_hashes", "identical_groups", "overlaps", "overlap_summary", "OverlapSummary", "OVERLAP_SHARE", "OVERLAP_ERROR"]

OVERLAP_SHARE = 0.25
"""Share of one rank's rows also seen by another rank above which they overlap (a warning):
correctly sharded data shares only the dataset's own duplicate samples, far fewer."""
OVERLAP_ERROR = 0.5
"""From this share on the overlap is an error: more than half of a rank's work repeats another's."""


def _tensors(batch: Any) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (tuple, list)) else []
    return [t for v in values for t in _tensors(v)]


def row_hashes(batch: Any) -> list[str]:
    """One 16-hex-digit hash per row (sample) of the batch; [] for a batch without tensors."""
    tensors = [t for t in _tensors(batch) if t.ndim >= 1]
    if not tensors:
        return []
    rows = tensors[0].shape[0]
    parts = []
    for t in tensors:
        if t.shape[0] != rows:
            continue
        flat = t.detach().cpu().contiguous().reshape(rows, -1)
        if flat.dtype == torch.bool:
            flat = flat.to(torch.uint8)
        if flat.is_complex():
            flat = torch.view_as_real(flat).reshape(rows, -1)
        parts.append(flat.view(torch.uint8) if flat.numel() else flat.to(torch.uint8))
    out = []
    for i in range(rows):
        h = hashlib.blake2b(digest_size=8)
        for p in parts:
            h.update(p[i].numpy().tobytes())
        out.append(h.hexdigest())
    return out


def identical_groups(seqs: dict[int, list[list[str]]]) -> list[list[int]]:
    """Groups of two or more ranks whose batches (hashes, in order) are all the same."""
    groups: dict[str, list[int]] = {}
    for rank, seq in sorted(seqs.items()):
        if any(seq):
            groups.setdefault(repr(seq), []).append(rank)
    return [g for g in groups.values() if len(g) > 1]


def overlaps(seqs: dict[int, list[list[str]]], skip: list[list[int]]) -> list[tuple[int, int, float, int]]:
    """(rank a, rank b, share, shared rows) for each pair of ranks not in one identical group:
    share = rows seen by both / rows of the rank that saw fewer."""
    same = {frozenset(p) for g in skip for p in combinations(g, 2)}
    sets = {r: {h for batch in seq for h in batch} for r, seq in seqs.items()}
    out = []
    for a, b in combinations(sorted(sets), 2):
        if frozenset((a, b)) in same or not sets[a] or not sets[b]:
            continue
        shared = len(sets[a] & sets[b])
        out.append((a, b, shared / min(len(sets[a]), len(sets[b])), shared))
    return out


@dataclass
class OverlapSummary:
    """What the data_shards finding says of the pairs `overlaps` gives above a share."""

    ranks: list[int] = field(default_factory=list)
    """Every rank of such a pair, ascending."""
    worst: float = 0.0
    """The largest share among them."""
    first: list[tuple[int, int, float, int]] = field(default_factory=list)
    """The first such pairs (a, b, share, shared rows), in the order of `overlaps`."""


def overlap_summary(
    seqs: dict[int, list[list[str]]], groups: list[list[int]], above: float, first: int = 8
) -> OverlapSummary:
    """The pairs of `overlaps(seqs, groups)` with share > `above` (> 0), summarised, without
    comparing every pair of ranks (16k ranks are 134M pairs, issue 21): only ranks holding a
    common row hash are compared, and the members of one identical group (disjoint groups, as
    identical_groups gives them) stand for each other."""
    classes: dict[Any, list[int]] = {}
    grouped: set[int] = set()
    for gid, group in enumerate(groups):
        for r in group:
            if r in seqs and r not in grouped:
                grouped.add(r)
                classes.setdefault((gid, frozenset(h for batch in seqs[r] for h in batch)), []).append(r)
    for r in seqs:
        if r not in grouped:
            classes[(None, r)] = [r]
    keys = list(classes)
    sets = [key[1] if key[0] is not None else {h for batch in seqs[key[1]] for h in batch} for key in keys]
    holders: dict[str, list[int]] = {}
    for c, hashes in enumerate(sets):
        for h in hashes:
            holders.setdefault(h, []).append(c)
    shared: dict[tuple[int, int], int] = {}
    for cs in holders.values():
        for pair in combinations(cs, 2):
            shared[pair] = shared.get(pair, 0) + 1
    partners: dict[int, list[tuple[int, float, int]]] = {}
    for (c, d), n in shared.items():
        if keys[c][0] is not None and keys[c][0] == keys[d][0]:
            continue  # one identical group: never compared
        share = n / min(len(sets[c]), len(sets[d]))
        if share > above:
            partners.setdefault(c, []).append((d, share, n))
            partners.setdefault(d, []).append((c, share, n))
    members = {c: sorted(classes[keys[c]]) for c in partners}
    ranks = sorted(r for c in partners for r in members[c])
    worst = max((share for links in partners.values() for _, share, _ in links), default=0.0)
    return OverlapSummary(ranks, worst, _first_pairs(ranks, partners, members, keys, first))


def _first_pairs(
    ranks: list[int], partners: dict[int, list[tuple[int, float, int]]], members: dict[int, list[int]],
    keys: list[Any], first: int,
) -> list[tuple[int, int, float, int]]:
    """The first `first` pairs (a < b) of ranks in partner classes, in ascending order."""
    class_of = {r: c for c, rs in members.items() for r in rs}
    out: list[tuple[int, int, float, int]] = []
    for a in ranks:
        found = []
        for d, share, n in partners[class_of[a]]:
            rs = members[d]
            start = bisect.bisect_right(rs, a)
            found += [(a, b, share, n) for b in rs[start : start + first]]
        out += sorted(found)[: first - len(out)]
        if len(out) >= first:
            break
    return out
