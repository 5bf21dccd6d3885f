"""Bug: gradient accumulation averages the micro-batch mean losses.

train_step splits the shard into 2 micro-batches; micro-batches hold different numbers of
valid tokens, so averaging their means weights tokens unequally. The healthy twin sums the
token losses and divides once by the global token count. Both clip the gradient norm.
"""

import torch
import torch.nn.functional as F
from _twin import HEALTHY

from distdiag.workloads import get_workload
from distdiag.workloads.base import split_batch

_w = get_workload("transformer")
build_model, make_batch, loss_fn, shard_batch = _w.build_model, _w.make_batch, _w.loss_fn, _w.shard_batch
MICRO = 2


def _token_losses(model, micro):
    tokens, mask = micro["tokens"], micro["mask"]
    logits = model(tokens[:, :-1])
    per_token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1), reduction="none")
    return per_token * mask.reshape(-1), mask


def train_step(model, batch, optimizer):
    total = 0.0
    for i in range(MICRO):
        micro = split_batch(batch, i, MICRO)
        losses, mask = _token_losses(model, micro)
        if HEALTHY:
            loss = losses.sum() * batch["world_size"] / batch["global_count"]
        else:
            loss = losses.sum() / mask.sum() / MICRO
        loss.backward()
        total += float(loss.detach())
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
    optimizer.step()
    return torch.tensor(total)
