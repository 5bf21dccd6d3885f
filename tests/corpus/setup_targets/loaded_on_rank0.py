"""Bug: the frozen encoder's checkpoint is read on rank 0 only (FSDP1 habit: sync_module_states
would have broadcast it), then fully_shard keeps each rank's slice of its own copy.
Twins (DISTDIAG_TWIN): "healthy" every rank loads it; "broadcast" rank 0 loads it and
parallelize broadcasts rank 0's state before fully_shard; "ddp" rank 0 loads it and
parallelize wraps the model in DDP, which broadcasts rank 0's state at construction."""

import os

import torch
import torch.distributed as dist
from _common import RANK, Net, checkpoint, loss_fn, make_batch  # noqa: F401
from torch.distributed.fsdp import fully_shard

TWIN = os.environ.get("DISTDIAG_TWIN", "")


def build_model():
    model = Net()
    if TWIN == "healthy" or RANK == 0:
        model.frozen.load_state_dict(checkpoint())
    return model


def parallelize(model, mesh):
    if TWIN == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model, process_group=mesh.get_group())
    if TWIN == "broadcast":
        for t in model.state_dict().values():
            dist.broadcast(t, src=0, group=mesh.get_group())
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def build_optimizer(params):
    return torch.optim.AdamW([p for p in params if p.requires_grad], lr=1e-3)
