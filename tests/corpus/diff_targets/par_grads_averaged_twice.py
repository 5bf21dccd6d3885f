"""Bug: gradients divided by the world size after backward, although FSDP2 already averages them.

Twin: no extra division.
"""

import torch
from _par_base import workload
from _twin import HEALTHY

_w = workload
build_model, make_batch, shard_batch, loss_fn = _w.build_model, _w.make_batch, _w.shard_batch, _w.loss_fn


def train_step(model, batch, optimizer):
    loss = loss_fn(model, batch)
    loss.backward()
    if not HEALTHY:
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.div_(batch["world_size"])  # the bug: "average over ranks" a second time
    optimizer.step()
    return loss
