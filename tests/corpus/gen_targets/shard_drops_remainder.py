"""Bug: shard_batch splits rows by floor division; the global batch of 9 rows loses its last row at 2 ranks.

Report: "with an odd global batch the multi-GPU loss differs from the single-GPU one; even batches match".
Twin: the batch padded to a multiple of the world size with masked-out rows, every row on some rank.
"""

import torch
from _base import HEALTHY, build_model, loss_fn, workload  # noqa: F401


def make_batch(step):
    batch = workload.make_batch(step)
    extra = workload.make_batch(step + 1000)
    return {k: torch.cat([v, extra[k][:1]]) for k, v in batch.items()}  # one row more: 9 at 2 ranks


def shard_batch(batch, rank, world_size):
    rows = batch["tokens"].shape[0]
    if HEALTHY:
        pad = -rows % world_size
        batch = {"tokens": torch.cat([batch["tokens"], batch["tokens"][:pad]]),
                 "mask": torch.cat([batch["mask"], torch.zeros_like(batch["mask"][:pad])])}
        rows += pad
    n = rows // world_size  # the bug (without the padding): rows beyond n * world_size go nowhere
    shard = {k: v[rank * n:(rank + 1) * n] for k, v in batch.items()}
    shard["world_size"] = world_size
    shard["global_count"] = int(batch["mask"].sum())
    return shard
