"""Bug: label smoothing is read from a per-rank config; rank 1 smooths with 0.1, rank 0 with 0.

Report: "the 2-GPU loss is a bit higher than the 1-GPU loss from the very first step, weights identical".
Twin: the same smoothing on every rank.
"""

import torch.nn.functional as F
from _base import HEALTHY, RANK, build_model, make_batch, shard_batch  # noqa: F401

SMOOTHING = {0: 0.0, 1: 0.1}


def loss_fn(model, batch):
    tokens, mask = batch["tokens"], batch["mask"]
    logits = model(tokens[:, :-1])
    eps = SMOOTHING[0] if HEALTHY else SMOOTHING[RANK % 2]
    per_token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1), reduction="none",
                                label_smoothing=eps)
    return (per_token * mask.reshape(-1)).sum() * batch["world_size"] / batch["global_count"]
