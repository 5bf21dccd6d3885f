"""Bug: the loss is normalised by this rank's number of valid tokens.

Ranks hold different numbers of valid tokens (padded rows), so the average over ranks of
per-rank means is not the global mean: every gradient is off. The healthy twin divides by
the global token count that shard_batch passes along.
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
    return (per_token * mask.reshape(-1)).sum() / mask.sum()
