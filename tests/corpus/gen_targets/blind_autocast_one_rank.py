"""Bug: loss_fn runs the forward under torch.autocast(bfloat16) when a per-node `bf16` flag is set; only node 1's launcher sets it.

Report: "rank 1's loss differs from rank 0's in the third digit on identical weights; the 1-GPU run matches rank 0".
Twin: autocast off on every rank (float32 everywhere, as the reference).
"""

import torch
import torch.nn.functional as F
from _base import HEALTHY, RANK, build_model, make_batch, shard_batch  # noqa: F401

BF16 = {0: False, 1: True}


def loss_fn(model, batch):
    tokens, mask = batch["tokens"], batch["mask"]
    on = not HEALTHY and BF16[RANK % 2]
    with torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=on):  # the bug: enabled on rank 1 only
        logits = model(tokens[:, :-1])
    logits = logits.float()
    per_token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1), reduction="none")
    return (per_token * mask.reshape(-1)).sum() * batch["world_size"] / batch["global_count"]
