"""Bug: the frozen encoder's checkpoint is read on rank 0 only (FSDP1 habit: sync_module_states
would have broadcast it), then fully_shard keeps each rank's slice of its own copy.
Twin: every rank loads it."""

import torch
from _common import HEALTHY, RANK, Net, checkpoint, loss_fn, make_batch  # noqa: F401
from torch.distributed.fsdp import fully_shard


def build_model():
    model = Net()
    if HEALTHY or RANK == 0:
        model.frozen.load_state_dict(checkpoint())
    return model


def parallelize(model, mesh):
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def build_optimizer(params):
    return torch.optim.AdamW([p for p in params if p.requires_grad], lr=1e-3)
