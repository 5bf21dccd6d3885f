"""The built-in transformer workload's hooks (sized for the world), and its masked token-loss sum, for the par_loss_*
corpus targets: each keeps only the normalisation it gets wrong."""

import os

import torch.nn.functional as F

from distdiag.workloads import get_workload

workload = get_workload("transformer", int(os.environ.get("WORLD_SIZE", "1")))
"""Sized for this run's world (its global batch a multiple of it: any world size runs)."""
build_model, make_batch, shard_batch = workload.build_model, workload.make_batch, workload.shard_batch


def token_loss_sum(model, batch):
    """This rank's summed next-token loss over its valid (masked-in) tokens."""
    tokens, mask = batch["tokens"], batch["mask"]
    logits = model(tokens[:, :-1])
    per_token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1), reduction="none")
    return (per_token * mask.reshape(-1)).sum()
