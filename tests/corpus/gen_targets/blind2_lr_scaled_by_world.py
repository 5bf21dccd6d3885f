"""Bug: train_step applies the linear learning-rate scaling rule with the world size (read from the parameters' mesh), but the global batch is the same at any world size: the 2-rank run steps at twice the learning rate.

Report: "mala rescales learning rate based on # of workers ... but this isn't always the case as mini
batch size can be fixed separately; we should scale LR based on the mini batch size instead"
(mala-project/mala issue #422). Symptom: "same global batch on 2 GPUs, and the loss curve moves twice as
fast as on one GPU; at step 1 the loss and gradients match".
Twin: the rule scales by the global batch (rows per rank x ranks) over the base batch: 1 here at any world.
"""

from _base import HEALTHY, build_model, loss_fn, make_batch, shard_batch  # noqa: F401
from torch.distributed.tensor import DTensor

BASE_LR, BASE_ROWS = 0.05, 8


def train_step(model, batch, optimizer):
    p = next(model.parameters())
    world = p.device_mesh.size() if isinstance(p, DTensor) else 1
    if HEALTHY:
        scale = batch["tokens"].shape[0] * world / BASE_ROWS
    else:
        scale = world  # the bug: the world size, though the global batch did not grow
    for group in optimizer.param_groups:
        group["lr"] = BASE_LR * scale
    loss = loss_fn(model, batch)
    loss.backward()
    optimizer.step()
    return loss
