"""Bug: rank 1's loss_fn takes the sum-reduced branch (a per-node `loss_reduction: sum` setting): the masked token-loss sum, never normalised.

Report: "rank 1's loss is ~50x rank 0's and the 2-GPU run blows up; the 1-GPU run trains fine".
Twin: every rank divides the token-loss sum by the global valid-token count, times the world size.
"""

import torch.nn.functional as F
from _base import HEALTHY, RANK, build_model, make_batch, shard_batch  # noqa: F401

REDUCTION = {0: "normalised", 1: "sum"}


def loss_fn(model, batch):
    tokens, mask = batch["tokens"], batch["mask"]
    logits = model(tokens[:, :-1])
    per_token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1), reduction="none")
    total = (per_token * mask.reshape(-1)).sum()
    if not HEALTHY and REDUCTION[RANK % 2] == "sum":
        return total  # the bug: the sum branch skips the normalisation
    return total * batch["world_size"] / batch["global_count"]
