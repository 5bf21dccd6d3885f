"""Bug: the loss is divided by the global token count but not multiplied by the world size.

FSDP2 averages gradients over the ranks, so a rank's loss must be its token-loss sum over the
global count TIMES the world size; without it every loss and gradient is 1/world of the
global batch's. Twin: the workload's loss (x world size).
"""

import torch.nn.functional as F
from _twin import HEALTHY

from distdiag.workloads import get_workload

_w = get_workload("transformer")
build_model, make_batch, shard_batch = _w.build_model, _w.make_batch, _w.shard_batch


def loss_fn(model, batch):
    if HEALTHY:
        return _w.loss_fn(model, batch)
    tokens, mask = batch["tokens"], batch["mask"]
    logits = model(tokens[:, :-1])
    per_token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1), reduction="none")
    return (per_token * mask.reshape(-1)).sum() / batch["global_count"]  # the bug: no x world_size
