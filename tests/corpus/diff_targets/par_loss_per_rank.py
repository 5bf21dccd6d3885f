"""Bug: the loss is normalised by this rank's valid-token count (ranks hold different counts).

Twin: divided by the global count, times the world size (the workload's loss).
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
    return (per_token * mask.reshape(-1)).sum() / mask.sum()  # the bug: this rank's count
