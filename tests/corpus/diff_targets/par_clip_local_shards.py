"""Bug: gradient clipping computed from each rank's local shards (its own norm, its own coefficient).

The clipping coefficient max_norm / ||g|| uses the norm of this rank's shards only, so each
rank scales its part of the gradient by a different factor. Twin: clip_grad_norm_ over the
DTensor parameters, which reduces the norm across ranks.
"""

import math

import torch
from _par_base import workload
from _twin import HEALTHY

_w = workload
build_model, make_batch, shard_batch, loss_fn = _w.build_model, _w.make_batch, _w.shard_batch, _w.loss_fn
MAX_NORM = 1e-3  # far below the gradient norm: every rank clips


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def train_step(model, batch, optimizer):
    loss = loss_fn(model, batch)
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if HEALTHY:
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    else:
        norm = math.sqrt(sum(float(_local(g).norm()) ** 2 for g in grads))  # the bug: this rank's shards only
        with torch.no_grad():
            for g in grads:
                _local(g).mul_(min(1.0, MAX_NORM / (norm + 1e-6)))
    optimizer.step()
    return loss
