"""What decides between a loss normalised per rank and a forward that differs per rank.

A per-rank mean (dividing by this rank's sample or token count) averages to the global mean
whenever every rank holds the same count: it can only explain a loss that differs from the
reference when the counts differ. `shard_counts` reads them from a rank's shard (its rows, and
its valid tokens where a mask or ignored labels say which), `cross_sample_modules` names what in
the forward mixes samples (BatchNorm in training mode without SyncBatchNorm: its statistics are
the rank's own rows').
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["shard_counts", "cross_sample_modules", "IGNORE_INDEX"]

IGNORE_INDEX = -100
"""The label torch's cross_entropy (and the Hugging Face models) leave out of the mean."""


def _leaves(value: object, key: str = "") -> list[tuple[str, torch.Tensor]]:
    """(key, tensor) of every tensor in a batch (a tensor, tuple/list or dict of them), in order."""
    if isinstance(value, torch.Tensor):
        return [(key, value)]
    if isinstance(value, dict):
        return [leaf for k, v in value.items() for leaf in _leaves(v, str(k))]
    if isinstance(value, tuple | list):
        return [leaf for v in value for leaf in _leaves(v, key)]
    return []


def shard_counts(shard: Any) -> dict[str, int]:
    """This rank's counts: `rows` (dim 0 of the first tensor), `valid` (the sum of a tensor
    named like a mask, else the labels that are not IGNORE_INDEX in the last integer tensor that
    holds any); {} for a batch with no tensor."""
    leaves = [(k, t) for k, t in _leaves(shard) if t.dim() > 0]
    if not leaves:
        return {}
    out = {"rows": int(leaves[0][1].shape[0])}
    masks = [t for k, t in leaves if "mask" in k.lower()]
    if masks:
        out["valid"] = int(masks[0].detach().to(torch.int64).sum())
        return out
    ignored = [t for _, t in leaves if not t.is_floating_point() and t.dtype != torch.bool and bool((t == IGNORE_INDEX).any())]
    if ignored:
        out["valid"] = int((ignored[-1] != IGNORE_INDEX).sum())
    return out


def cross_sample_modules(model: torch.nn.Module, limit: int = 8) -> list[str]:
    """Modules whose training-mode forward mixes the samples of the rank's batch: BatchNorm layers
    (not SyncBatchNorm) in training mode, the first `limit` by name (every rank posts them: a ResNet's
    fifty norms at 16k ranks would be megabytes for a list the finding cuts to four)."""
    from torch.nn.modules.batchnorm import _BatchNorm

    from distdiag.probes.training import canonical_name

    names = [canonical_name(name) or "(root)" for name, m in model.named_modules()
             if isinstance(m, _BatchNorm) and not isinstance(m, torch.nn.SyncBatchNorm) and m.training]
    return names[:limit]
