"""Row hashes of a batch, and what comparing them across ranks and epochs says.

A batch (a tensor, or a tuple/list/dict of values) is cut into rows along dim 0: row i is
row i of every tensor whose dim 0 is the batch size. A row's hash covers its bytes in all
those tensors, so two ranks given the same sample (same tokens, same label) hash it alike
whatever order or batch it comes in. Only hashes travel; no data leaves a rank.
"""

from __future__ import annotations

import hashlib
from itertools import combinations
from typing import Any

import torch

__all__ = ["row_hashes", "identical_groups", "overlaps", "OVERLAP_SHARE", "OVERLAP_ERROR"]

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
