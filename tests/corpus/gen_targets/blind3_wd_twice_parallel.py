"""Bug: on the sharded path, train_step applies decoupled weight decay to the parameters itself (`p *= 1 - lr * wd`, as a distributed optimizer wrapper does on its shards) while the inner AdamW keeps its own `weight_decay`: the parallel run decays every parameter twice per step, the single-process run once.

Report: "decoupled_weight_decay=True but optimizer also has weight_decay=0.1. Double decay! ... every step
applies decay twice: `_apply_decoupled_weight_decay()` ... `param *= (1 - lr * wd)` on FP32 shards ... AdamW
... also applies its own ... decay because `pg['weight_decay']` was never zeroed" (dylanyunlon/Neuron_SP
issue #13, a DeepSpeed/Megatron-style distributed optimizer); nntrainer/nntrainer pull request #218 ("fix bugs
that weight_decay was applying twice"). Symptom: "the weights shrink faster on 2 GPUs than on 1; the loss at
step 1 and the gradients match".
Twin: the wrapper decays only parameter groups whose inner optimizer has `weight_decay == 0` (none here), so
AdamW's own decay is the only one, as in the single run.
"""

import torch
from _base import HEALTHY, build_model, loss_fn, make_batch, shard_batch  # noqa: F401
from torch.distributed.tensor import DTensor

LR, WEIGHT_DECAY = 0.02, 0.5


def build_optimizer(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)


def _apply_decoupled_weight_decay(optimizer):
    """The distributed wrapper's decay of the sharded parameters (what it does instead of the inner optimizer)."""
    with torch.no_grad():
        for group in optimizer.param_groups:
            if HEALTHY and group["weight_decay"] != 0:
                continue  # the fix: the inner optimizer already decays this group
            for p in group["params"]:
                if isinstance(p, DTensor):
                    p.to_local().mul_(1 - group["lr"] * WEIGHT_DECAY)  # the bug: on top of AdamW's own decay


def train_step(model, batch, optimizer):
    loss = loss_fn(model, batch)
    loss.backward()
    _apply_decoupled_weight_decay(optimizer)
    optimizer.step()
    return loss
