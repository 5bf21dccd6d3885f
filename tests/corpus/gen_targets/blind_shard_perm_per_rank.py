"""Bug: shard_batch shuffles the rows with a generator seeded by rank, then each rank takes its slice of its OWN permutation: rows overlap and others are dropped.

Report: "the 2-GPU loss curve is noisier than the 1-GPU one and never matches it, even at step 1".
Twin: one permutation, seeded the same on every rank, sliced by rank.
"""

import torch
from _base import HEALTHY, build_model, loss_fn, make_batch  # noqa: F401

from distdiag.workloads.base import annotate

SEED = 1234


def shard_batch(batch, rank, world_size):
    rows = batch["tokens"].shape[0]
    gen = torch.Generator().manual_seed(SEED if HEALTHY else SEED + rank)  # the bug: a per-rank seed
    order = torch.randperm(rows, generator=gen)
    per = rows // world_size
    idx = order[rank * per:(rank + 1) * per]
    part = {"tokens": batch["tokens"][idx], "mask": batch["mask"][idx]}
    return annotate(part, world_size, int(batch["mask"].sum()))
