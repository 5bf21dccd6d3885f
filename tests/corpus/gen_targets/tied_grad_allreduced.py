"""Bug: the head's gradient is all-reduced by hand in train_step ("tied weights are not synced") on top of FSDP's reduce-scatter.

Report: "only head.weight's gradient is wrong after switching to FSDP2; the manual all_reduce was needed under our old wrapper".
Twin: no manual reduction (FSDP2 already averages head.weight).
"""

import torch.distributed as dist
from _base import HEALTHY, build_model, loss_fn, make_batch, shard_batch  # noqa: F401


def train_step(model, batch, optimizer):
    loss = loss_fn(model, batch)
    loss.backward()
    grad = model.head.weight.grad
    if not HEALTHY and hasattr(grad, "to_local"):  # only in the distributed run
        local = grad.to_local()
        dist.all_reduce(local)
        local.div_(dist.get_world_size())
    optimizer.step()
    return loss
