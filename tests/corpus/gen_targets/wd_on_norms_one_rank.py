"""Bug: the no-weight-decay list (norms, biases) is read from a file only rank 0 finds; other ranks decay every parameter.

Report: "LayerNorm weights shrink on some ranks only; loss drifts from the single-GPU run from step 2".
Twin: every rank excludes 1-D parameters from weight decay.
"""

import torch
from _base import HEALTHY, RANK, build_model, loss_fn, make_batch, shard_batch  # noqa: F401


def build_optimizer(params):
    params = list(params)
    if HEALTHY or RANK == 0:
        decay = [p for p in params if p.dim() > 1]
        no_decay = [p for p in params if p.dim() <= 1]
        groups = [{"params": decay, "weight_decay": 0.5}, {"params": no_decay, "weight_decay": 0.0}]
    else:  # the bug: the list was not found, every parameter decays
        groups = [{"params": params, "weight_decay": 0.5}]
    return torch.optim.SGD(groups, lr=0.05)
