"""Bug: a hand-written global clip all-reduces each rank's local gradient norm (FSDP2 shards) and
takes the sum as the total: the sum of the ranks' norms, not the root of the sum of their squares,
so every rank clips harder than one process does. The twin all-reduces the squares. Sized for the
world (WORLD_SIZE), so that it runs at 2, 3 or 4 ranks.
"""

import os

import torch
import torch.distributed as dist
from _twin import HEALTHY
from torch.distributed.tensor import DTensor

from distdiag.workloads import get_workload

_w = get_workload("transformer", int(os.environ.get("WORLD_SIZE", "1")))
build_model, make_batch, loss_fn, shard_batch = _w.build_model, _w.make_batch, _w.loss_fn, _w.shard_batch
MAX_NORM = 0.25


def _total_norm(grads):
    local = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.to_local() if isinstance(g, DTensor) else g)
                                                  for g in grads]))
    if not any(isinstance(g, DTensor) for g in grads):
        return local  # one process: the whole gradient is here
    if HEALTHY:
        squared = local.pow(2)
        dist.all_reduce(squared)
        return squared.sqrt()
    dist.all_reduce(local)  # the bug: the sum of the norms
    return local


def train_step(model, batch, optimizer):
    optimizer.zero_grad(set_to_none=True)
    loss = loss_fn(model, batch)
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    coef = torch.clamp(MAX_NORM / (_total_norm(grads) + 1e-6), max=1.0)
    with torch.no_grad():
        for g in grads:
            (g.to_local() if isinstance(g, DTensor) else g).mul_(coef)
    optimizer.step()
    return loss.detach()
