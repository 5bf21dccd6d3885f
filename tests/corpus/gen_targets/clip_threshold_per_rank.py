"""Bug: max_grad_norm comes from a per-node config; node 1's file says 2x node 0's, so ranks clip by different thresholds.

Report: "loss curves of a 2-node run drift from the 1-node run after the first step; clip_grad_norm_
is called on the DTensor parameters, so the norm is global". Twin: one threshold on every rank.
"""

import torch
from _base import HEALTHY, RANK, build_model, loss_fn, make_batch, shard_batch  # noqa: F401

MAX_NORM = {0: 0.1, 1: 0.4}  # what each node's config file says


def train_step(model, batch, optimizer):
    loss = loss_fn(model, batch)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM[0] if HEALTHY else MAX_NORM[RANK % 2])
    optimizer.step()
    return loss
